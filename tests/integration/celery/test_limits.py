"""lock_limit=3 under real workers: never more than 3 calls of a key at once, nothing lost.

Every call records its execution (tests/celery_apps/limits.py); the history
checker (:class:`tests.celery_harness.History`) proves the limit by Redis's
counter of executions inside and by the recorded intervals, and that fences
rise: distinct per key, and in start order within each permit slot (a slot
has one holder at a time).
"""

from __future__ import annotations

import json
import os
import random
import signal
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_redlock.core.holder import Holder
from celery_redlock.core.semaphore_scripts import semaphore_keys
from celery_redlock.ops.cli import redlock
from tests.celery_apps.limits import LIMIT, started
from tests.celery_harness import History, running_key, task_states, wait_until
from tests.integration.celery.conftest import WorkerFactory

SETTLED = frozenset({"SUCCESS", "FAILURE", "SKIPPED"})


def submit(app: Celery, task: str, calls: Sequence[tuple[str, float, str | None]]) -> list[str]:
    """Publish one call per (group, seconds, gate); return the task ids."""
    with app.producer_or_acquire() as producer:
        return [
            app.tasks[task].apply_async((group, seconds, gate), producer=producer).id
            for group, seconds, gate in calls
        ]


def settle(app: Celery, ids: Sequence[str], timeout: float) -> dict[str, tuple[str, Any]]:
    """Wait until every call is SUCCESS, FAILURE or SKIPPED; return their states."""
    last: dict[str, tuple[str, Any]] = {}

    def settled() -> bool:
        last.update(task_states(app, ids))
        return all(state in SETTLED for state, _ in last.values())

    wait_until(
        settled,
        timeout,
        interval=0.2,
        message=lambda: f"calls to settle; have {Counter(s for s, _ in last.values())}",
    )
    return last


def invoke(app: Celery, *args: str) -> Result:
    """Run ``celery redlock <args>`` in this process against ``app``."""
    return CliRunner().invoke(
        redlock, list(args), obj=CLIContext(app=app, no_color=True, workdir=None)
    )


def random_calls(count: int, seed: int) -> list[tuple[str, float, str | None]]:
    """``count`` calls on one key, each running 0 to 50 ms."""
    draw = random.Random(seed)
    return [("g", draw.uniform(0, 0.05), None) for _ in range(count)]


@pytest.mark.timeout(240)
def test_two_prefork_workers_run_200_calls_three_at_a_time(
    storm_app: Celery, worker_factory: WorkerFactory, history: History
) -> None:
    """lock_limit=3, 200 calls on one key, two prefork -c 4 workers, requeue: all 200 run,
    never more than 3 at once, each in slot 0-2, fences rising."""
    worker_factory.start(worker_factory.create("prefork", 4), worker_factory.create("prefork", 4))
    ids = submit(storm_app, "limits.requeue", random_calls(200, seed=19))
    states = settle(storm_app, ids, timeout=200)

    assert Counter(state for state, _ in states.values()) == {"SUCCESS": 200}
    executions = history.executions()
    assert sorted(e.task_id for e in executions) == sorted(ids)
    history.assert_at_most_per_key(LIMIT)
    history.assert_fences_rise_per_slot()
    assert {e.extra["slot"] for e in executions} <= set(range(LIMIT))
    assert max(e.holders for e in executions) > 1, "the calls never ran side by side"


@pytest.mark.timeout(240)
def test_200_calls_under_skip_are_run_or_skipped_never_more_than_3_at_once(
    storm_app: Celery, worker_factory: WorkerFactory, history: History
) -> None:
    """Under skip every call is accounted for: it ran (SUCCESS, with its execution on
    record) or was skipped as over the limit (SKIPPED); never more than 3 at once."""
    worker_factory.start(worker_factory.create("prefork", 4), worker_factory.create("prefork", 4))
    ids = submit(storm_app, "limits.skip", random_calls(200, seed=7))
    states = settle(storm_app, ids, timeout=200)

    outcomes = Counter(state for state, _ in states.values())
    assert set(outcomes) <= {"SUCCESS", "SKIPPED"}, outcomes
    ran = {task_id for task_id, (state, _) in states.items() if state == "SUCCESS"}
    assert {e.task_id for e in history.executions()} == ran
    history.assert_at_most_per_key(LIMIT)
    history.assert_fences_rise_per_slot()


@pytest.mark.parametrize("pool", ["solo", "threads"])
@pytest.mark.timeout(120)
def test_solo_and_thread_pools_respect_the_limit(
    pool: str, storm_app: Celery, worker_factory: WorkerFactory, history: History
) -> None:
    """Every pool runs limited calls: a threads -c 6 worker never more than 3 at once."""
    worker_factory(pool, 6 if pool == "threads" else 1)
    ids = submit(storm_app, "limits.requeue", random_calls(24, seed=3))
    states = settle(storm_app, ids, timeout=100)

    assert Counter(state for state, _ in states.values()) == {"SUCCESS": 24}
    history.assert_at_most_per_key(LIMIT)
    history.assert_fences_rise_per_slot()
    fences = {task_id: result["fence"] for task_id, (_, result) in states.items()}
    assert {e.task_id: e.fence for e in history.executions()} == fences


def permit_of(db9: redis.Redis, key: str, task_id: str) -> bytes | None:
    """The member of ``key``'s permits set held by ``task_id``, if any."""
    for member in db9.zrange(semaphore_keys(key).permits, 0, -1):
        holder = Holder.parse(member.split(b"|", 2)[2])
        if holder is not None and holder.task_id == task_id:
            return bytes(member)
    return None


@pytest.mark.timeout(120)
def test_sigkill_of_a_permit_holder_frees_its_slot_and_loses_nothing(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """A pool process holding a permit is SIGKILLed mid-task (acks_late, reject on worker
    lost): its permit is reclaimed once its TTL runs out, the redelivered copy waits for
    its own dead permit instead of being skipped, and every call runs."""
    worker = worker_factory("prefork", 4)
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    ids = submit(storm_app, "limits.mortal", [("g", 0, gate)] * 4)
    wait_until(lambda: len(started(db9, prefix)) >= LIMIT, 30, message="three holders")
    victim = started(db9, prefix)[0]
    key = victim["key"]
    dead_permit = permit_of(db9, key, victim["task_id"])
    assert dead_permit is not None and victim["pid"] in worker.child_pids()
    os.kill(victim["pid"], signal.SIGKILL)
    # The killed execution, stuck at its gate, never leaves the counter of executions
    # inside: leave it for it now, before any other execution can start.
    db9.decr(running_key(prefix, key))

    # The dead permit is reclaimed (by an acquire after its expiry), not leaked.
    wait_until(
        lambda: dead_permit not in db9.zrange(semaphore_keys(key).permits, 0, -1),
        30,
        message="the killed holder's permit to be reclaimed",
    )
    db9.set(gate, 1)
    states = settle(storm_app, ids, timeout=60)

    assert Counter(state for state, _ in states.values()) == {"SUCCESS": 4}
    history.assert_at_most_per_key(LIMIT)
    history.assert_fences_rise_per_slot()
    (rerun,) = [e for e in history.executions() if e.task_id == victim["task_id"]]
    assert rerun.fence > victim["fence"]
    starts = [s for s in started(db9, prefix) if s["task_id"] == victim["task_id"]]
    assert len(starts) == 2, starts  # killed once, ran once more: never skipped


@pytest.mark.timeout(60)
def test_a_call_next_in_line_is_charged_its_wait_not_its_polls(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """lock_max_requeues=3, requeue_delay=1 s: the plain backoff would requeue a call 1 s,
    then 2 s later. Next in line, it polls every 0.25 s; after waiting 2.5 s (ten polls) it
    has been charged 1 requeue, so it runs when the holders finish instead of failing."""
    worker_factory("prefork", 4)
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    ids = submit(storm_app, "limits.few_requeues", [("g", 0, gate)] * LIMIT)
    wait_until(lambda: len(started(db9, prefix)) >= LIMIT, 30, message="three holders")
    key = started(db9, prefix)[0]["key"]
    (waiter,) = submit(storm_app, "limits.few_requeues", [("g", 0, None)])
    line = semaphore_keys(key).waiters

    def waited_ms() -> float:
        arrival = db9.zscore(line, waiter)
        seconds, micros = db9.time()
        return 0 if arrival is None else seconds * 1000 + micros / 1000 - arrival / 1000

    wait_until(lambda: waited_ms() >= 2500, 30, message="the waiter to wait 2.5 s in line")
    db9.set(gate, 1)
    states = settle(storm_app, [*ids, waiter], timeout=30)
    assert states[waiter][0] == "SUCCESS", states[waiter]


@pytest.mark.timeout(60)
def test_revoke_with_sigkill_frees_the_killed_holders_permit_from_the_main_process(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """A pool process killed by revoke(signal=SIGKILL) cannot give its permit back; its
    worker removes exactly that permit, and the other holders keep theirs."""
    worker = worker_factory("prefork", 3)
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    ids = submit(storm_app, "limits.skip", [("g", 0, gate)] * 2)
    wait_until(lambda: len(started(db9, prefix)) == 2, 30, message="two holders")
    victim, survivor = started(db9, prefix)
    key = victim["key"]
    storm_app.control.revoke(victim["task_id"], terminate=True, signal="SIGKILL")
    wait_until(
        lambda: permit_of(db9, key, victim["task_id"]) is None,
        30,
        message="the killed holder's permit to be removed",
    )
    log = f"task limits.skip[{victim['task_id']}] was killed; released its lock {key}"
    wait_until(lambda: log in worker.log(), 10, message="the worker's release")
    assert permit_of(db9, key, survivor["task_id"]) is not None
    db9.set(gate, 1)
    assert settle(storm_app, [survivor["task_id"]], timeout=30)[survivor["task_id"]][0] == "SUCCESS"
    assert sorted(ids) == sorted([victim["task_id"], survivor["task_id"]])


@pytest.mark.timeout(90)
def test_operator_view_lists_each_permit_and_frees_one_by_its_token(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """`list` and `show` name every permit holder (task id, worker, pid, fence, TTL);
    `release --permit TOKEN` refuses a live holder unless forced, and then frees that
    permit only; `purge` removes the rest."""
    worker = worker_factory("threads", 4)  # answers pings while its tasks wait
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    ids = submit(storm_app, "limits.skip", [("g", 0, gate)] * LIMIT)
    try:
        wait_until(lambda: len(started(db9, prefix)) == LIMIT, 30, message="three holders")
        key = started(db9, prefix)[0]["key"]

        listed = json.loads(invoke(storm_app, "list", "--json", "--task", "limits.skip").output)
        (entry,) = listed
        assert entry["key"] == key and entry["kind"] == "semaphore"
        permits = entry["permits"]
        assert sorted(p["holder"]["task_id"] for p in permits) == sorted(ids)
        assert [p["slot"] for p in permits] == [0, 1, 2]
        assert {p["holder"]["hostname"] for p in permits} == {worker.nodename}
        assert all(p["holder"]["pid"] == worker.pid for p in permits)
        assert all(0 < p["ttl"] <= 2.0 and p["fence"] > 0 for p in permits)
        text = invoke(storm_app, "list").output
        assert all(f"{key} (permit {slot})" in text for slot in range(LIMIT))

        shown = invoke(storm_app, "show", key).output
        assert "semaphore, 3 permit(s) held" in shown
        assert all(task_id in shown for task_id in ids)

        unnamed = invoke(storm_app, "release", key)
        assert unnamed.exit_code == 1 and "--permit" in unnamed.output
        token = permits[1]["token"]
        refused = invoke(storm_app, "release", key, "--permit", token)
        assert refused.exit_code == 1 and "answers ping" in refused.output
        assert db9.zcard(semaphore_keys(key).permits) == LIMIT
        forced = invoke(storm_app, "release", key, "--permit", token, "--force")
        assert forced.exit_code == 0, forced.output
        assert f"released permit 1 of {key} (forced)" in forced.output
        left = json.loads(invoke(storm_app, "list", "--json").output)[0]["permits"]
        assert [p["slot"] for p in left] == [0, 2]
        purged = invoke(storm_app, "purge", "--task", "limits.skip", "--yes")
        assert purged.exit_code == 0 and "deleted 1 lock(s)" in purged.output, purged.output
        assert db9.zcard(semaphore_keys(key).permits) == 0
    finally:
        db9.set(gate, 1)
    settle(storm_app, ids, timeout=30)
