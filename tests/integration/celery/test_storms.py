"""Duplicate storms against real workers of every pool: the lock lets one call run at a time.

Three workers consume one queue: prefork with two processes, solo, and
threads with four, so seven executors race for every lock. The storms run
on Redis and on RabbitMQ; results and locks are always in Redis.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest
import redis
from celery import Celery

from celery_redlock import SKIPPED
from tests.celery_harness import CeleryWorker, History, task_states, wait_until

if TYPE_CHECKING:
    from tests.integration.celery.conftest import WorkerFactory

pytestmark = pytest.mark.slow

BROKER_PARAMS = pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)
STORM = 200


def submit(task: Any, args: Sequence[Any], count: int, **options: Any) -> list[str]:
    """Send ``count`` copies of one call over one producer; return their ids."""
    with task.app.producer_or_acquire() as producer:
        return [task.apply_async(args, producer=producer, **options).id for _ in range(count)]


def wait_for_states(
    app: Celery, task_ids: Sequence[str], done: set[str], timeout: float
) -> dict[str, tuple[str, Any]]:
    """Wait until every task is in one of the ``done`` states; return all states."""
    last: dict[str, tuple[str, Any]] = {}

    def settled() -> bool:
        last.update(task_states(app, task_ids))
        return all(state in done for state, _ in last.values())

    wait_until(
        settled,
        timeout,
        interval=0.1,
        message=lambda: f"states {sorted(done)}; have {Counter(s for s, _ in last.values())}",
    )
    return last


def contended_ids(workers: Sequence[CeleryWorker], task_name: str, action: str) -> list[set[str]]:
    """Per worker, the ids of tasks that logged finding their lock held, then ``action``."""
    line = re.compile(rf"{re.escape(task_name)}\[([0-9a-f-]+)\]: .* holds lock \S+; {action}$")
    return [
        {m.group(1) for m in map(line.search, worker.log().splitlines()) if m} for worker in workers
    ]


def take_lock_first(task: Any, args: Sequence[Any], history: History) -> tuple[str, str]:
    """Send one call and wait until it runs under its lock; return (task id, lock key)."""
    key = task.lock_key_for(*args)
    first = task.apply_async(args).id
    wait_until(lambda: history.running(key) == 1, 30, message=f"{first} to take {key}")
    return first, key


@BROKER_PARAMS
@pytest.mark.timeout(120)
def test_skip_storm_runs_the_first_and_skips_every_duplicate(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """While one call runs, 199 copies of it across all pools are each SKIPPED naming it.

    Twenty of them carry a ``link``: a skipped copy ends without running it.
    """
    workers = worker_factory.trio()
    hold = storm_app.tasks["storm.hold"]
    plain = storm_app.tasks["storm.plain"]
    gate = f"{prefix}:gate"
    args = (7, 0.0, gate)
    first, key = take_lock_first(hold, args, history)

    linked = submit(hold, args, 20, link=plain.si("linked", 0.0))
    duplicates = submit(hold, args, STORM - 21) + linked
    states = wait_for_states(storm_app, duplicates, {SKIPPED}, timeout=60)
    db9.set(gate, 1)
    wait_for_states(storm_app, [first], {"SUCCESS"}, timeout=30)
    # Sent after every link a skip could have sent: once it has run, they would have.
    sentinel = plain.apply_async(("sentinel", 0.0)).id
    wait_for_states(storm_app, [sentinel], {"SUCCESS"}, timeout=30)

    executions = [e for e in history.executions() if e.task_id != sentinel]
    assert [e.task_id for e in executions] == [first]
    (execution,) = executions
    assert "gate_timeout" not in execution.extra
    assert execution.key == key
    expected = {
        "reason": "duplicate",
        "key": key,
        "holder": first,
        "holder_hostname": execution.hostname,
    }
    wrong = {task_id: meta for task_id, (_, meta) in states.items() if meta != expected}
    assert not wrong, f"{len(wrong)} SKIPPED metas differ from {expected}, e.g. {wrong}"
    # Every pool took part: it ran the first call (which blocks a solo worker) or skipped copies.
    skipped_by = contended_ids(workers, "storm.hold", "skip")
    idle = [
        w.nodename
        for w, ids in zip(workers, skipped_by)
        if not ids and w.nodename != execution.hostname
    ]
    assert not idle, [len(ids) for ids in skipped_by]
    assert set().union(*skipped_by) == set(duplicates)
    history.assert_no_overlap_per_key()


@BROKER_PARAMS
@pytest.mark.parametrize("acks_late", [True], ids=["acks_late"])
@pytest.mark.timeout(180)
def test_requeue_storm_runs_every_copy_once_and_one_at_a_time(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """200 copies of one call requeued while the first runs all execute, once each, serially."""
    workers = worker_factory.trio()
    task = storm_app.tasks["storm.hold_requeue"]
    gate = f"{prefix}:gate"
    args = (7, 0.02, gate)
    first, key = take_lock_first(task, args, history)

    duplicates = submit(task, args, STORM - 1)
    # Every duplicate meets the first's lock and is requeued before the first may finish.
    wait_until(
        lambda: (
            set().union(*contended_ids(workers, "storm.hold_requeue", "requeue")) >= set(duplicates)
        ),
        60,
        interval=0.2,
        message="every duplicate to be requeued at least once",
    )
    db9.set(gate, 1)
    submitted = [first, *duplicates]
    states = wait_for_states(storm_app, submitted, {"SUCCESS", "FAILURE"}, timeout=120)

    failed = {task_id: meta for task_id, (state, meta) in states.items() if state != "SUCCESS"}
    assert not failed
    executions = history.executions()
    runs = Counter(e.task_id for e in executions)
    assert set(runs) == set(submitted)
    assert set(runs.values()) == {1}, runs.most_common(3)
    assert all("gate_timeout" not in e.extra for e in executions)
    assert {e.key for e in executions} == {key}
    assert min(executions, key=lambda e: e.start).task_id == first
    history.assert_no_overlap_per_key()
    history.assert_fences_increase_per_key()
    assert {e.hostname for e in executions} == {w.nodename for w in workers}


@BROKER_PARAMS
@pytest.mark.parametrize("acks_late", [True], ids=["acks_late"])
@pytest.mark.timeout(150)
def test_many_signatures_serialise_per_key_and_run_in_parallel_across_keys(
    storm_app: Celery, worker_factory: WorkerFactory, history: History
) -> None:
    """500 calls over 20 signatures: one key never runs twice at once; different keys overlap."""
    workers = worker_factory.trio()
    task = storm_app.tasks["storm.hold_requeue"]
    signatures = 20
    submitted: list[str] = []
    with storm_app.producer_or_acquire() as producer:
        for i in range(500):
            call = (i % signatures, 0.03)
            submitted.append(task.apply_async(call, producer=producer).id)

    states = wait_for_states(storm_app, submitted, {"SUCCESS", "FAILURE"}, timeout=120)

    assert Counter(state for state, _ in states.values()) == {"SUCCESS": 500}
    executions = history.executions()
    assert sorted(e.task_id for e in executions) == sorted(submitted)
    by_key = history.by_key()
    assert len(by_key) == signatures
    assert {len(group) for group in by_key.values()} == {500 // signatures}
    history.assert_no_overlap_per_key()
    history.assert_fences_increase_per_key()
    assert history.overlapping_pairs(), "no two different keys ever ran at the same time"
    assert {e.hostname for e in executions} == {w.nodename for w in workers}
    prefork = workers[0]
    prefork_pids = {e.pid for e in executions if e.hostname == prefork.nodename}
    assert len(prefork_pids) == 2, f"prefork -c 2 ran in {prefork_pids}"


@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 2), ("solo", 1), ("threads", 2)])
@pytest.mark.timeout(60)
def test_lock_is_held_for_four_times_its_ttl(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    queue: str,
    pool: str,
    concurrency: int,
) -> None:
    """A task running for 4x its 1 s lock TTL keeps its lock throughout; a late duplicate skips."""
    contender_queue = f"{queue}.contender"
    subject, _contender = worker_factory.start(
        worker_factory.create(pool, concurrency),
        worker_factory.create("solo", queues=[contender_queue]),
    )
    task = storm_app.tasks["storm.long_hold"]
    first, key = take_lock_first(task, (4.0,), history)
    # Past two TTLs, so without renewal the key would have expired by now, and
    # early enough that the contender meets the lock well before the run ends.
    time.sleep(2.1)
    (late,) = submit(task, (4.0,), 1, queue=contender_queue)
    late_state = wait_for_states(storm_app, [late], {SKIPPED}, timeout=10)[late]
    result = wait_for_states(storm_app, [first], {"SUCCESS", "FAILURE"}, timeout=15)[first]

    assert result[0] == "SUCCESS", result
    report = result[1]
    assert report["lost"] is False
    assert report["mismatches"] == []
    assert report["checks"] >= 12, report
    assert all(0 < pttl <= 1000 for pttl in report["pttls"]), report["pttls"]
    assert report["renewals"] >= 8, report
    assert late_state[1]["holder"] == first
    (execution,) = history.executions()
    assert execution.hostname == subject.nodename
    assert execution.end - execution.start >= 4.0
    assert db9.exists(key) == 0
