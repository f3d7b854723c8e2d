"""Lock windows against real workers: enqueue locks, their handover, and what lets them go.

Each test uses the gated mode tasks of ``tests.celery_apps.modes``: a copy
waits for a gate key, so the test controls when it is queued, running or done.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import redis
from celery import Celery, chain, group

from celery_redlock import SKIPPED, DuplicateTask, LockError
from celery_redlock.celery.window import reservation_key
from celery_redlock.core.holder import Holder
from tests.celery_apps import modes, storm
from tests.celery_harness import History, wait_until

if TYPE_CHECKING:
    from tests.integration.celery.conftest import WorkerFactory

ENQUEUE_MODES = ("until_executing", "until_executed", "until_and_while_executing")
# The enqueue lock lives in Redis whatever the broker; these tests also run with
# RabbitMQ, whose countdowns, revokes and rejections take other code paths in kombu.
BOTH_BROKERS = pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)


def holder_of(db9: redis.Redis, key: str) -> str | None:
    """The task id named by the value under ``key``, if any."""
    holder = Holder.parse(db9.get(key))
    return holder.task_id if holder else None


def starts(db9: redis.Redis, prefix: str, task_id: str | None = None) -> list[dict[str, Any]]:
    """Start records, all or those of ``task_id``."""
    records = modes.started(db9, prefix)
    return [r for r in records if task_id is None or r["task_id"] == task_id]


def wait_started(db9: redis.Redis, prefix: str, task_id: str, count: int = 1) -> None:
    wait_until(
        lambda: len(starts(db9, prefix, task_id)) >= count,
        timeout=20,
        message=f"{count} start(s) of {task_id}",
    )


def queued_messages(db9: redis.Redis, prefix: str, queue: str) -> int:
    """Messages waiting in the test's Redis broker queue (kombu's list, under the prefix)."""
    return int(db9.llen(f"{prefix}:{queue}"))


def call_duplicate(task: Any, on_duplicate: str, holder_id: str, *args: Any) -> None:
    """Call ``task`` while ``holder_id`` holds the reservation; check the outcome."""
    if on_duplicate == "return_existing":
        assert task.delay(*args).id == holder_id
        return
    with pytest.raises(DuplicateTask) as info:
        task.delay(*args)
    assert info.value.task_id == holder_id
    assert info.value.holder_ttl is not None and 0 < info.value.holder_ttl <= 600


def gate_name(prefix: str) -> str:
    return f"{prefix}:gate:{uuid.uuid4().hex}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_duplicate", modes.DUPLICATE_POLICIES)
@pytest.mark.parametrize("mode", ENQUEUE_MODES)
def test_duplicates_while_queued_and_while_running(
    mode: str,
    on_duplicate: str,
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    history: History,
    prefix: str,
    queue: str,
) -> None:
    """Queued: every mode folds or refuses a duplicate. Running: only until_executed does."""
    task = storm_app.tasks[modes.task_name(mode, on_duplicate)]
    gate = gate_name(prefix)
    key = task.lock_key_for(1, gate)
    rkey = reservation_key(mode, key)
    first = task.delay(1, gate)  # no worker yet: it stays queued
    assert holder_of(db9, rkey) == first.id
    call_duplicate(task, on_duplicate, first.id, 1, gate)
    assert queued_messages(db9, prefix, queue) == 1

    worker_factory("solo")
    wait_started(db9, prefix, first.id)
    if mode == "until_executed":
        assert holder_of(db9, key) == first.id
        call_duplicate(task, on_duplicate, first.id, 1, gate)
        expected = [first.id]
    else:
        # The reservation went when the first copy started: one more may queue.
        assert not db9.exists(rkey)
        second = task.delay(1, gate)
        assert second.id != first.id
        assert holder_of(db9, rkey) == second.id
        call_duplicate(task, on_duplicate, second.id, 1, gate)
        expected = [first.id, second.id]
    db9.set(gate, 1)
    for task_id in expected:
        assert storm_app.AsyncResult(task_id).get(timeout=20) == 1
    assert [e.task_id for e in history.executions()] == expected
    assert not db9.exists(rkey) and not db9.exists(key)
    assert not db9.exists(modes.lapsed_key(prefix))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("on_duplicate", modes.DUPLICATE_POLICIES)
def test_while_executing_publishes_every_call(
    on_duplicate: str, storm_app: Celery, db9: redis.Redis, prefix: str, queue: str
) -> None:
    """The default window leaves the queue alone: every call is published, nothing reserved."""
    task = storm_app.tasks[modes.task_name("while_executing", on_duplicate)]
    ids = {task.delay(1).id for _ in range(3)}
    assert len(ids) == 3
    assert queued_messages(db9, prefix, queue) == 3
    key = task.lock_key_for(1)
    assert not db9.exists(key) and not db9.exists(f"{key}:queued")


@BOTH_BROKERS
@pytest.mark.timeout(60)
def test_hundred_delays_one_execution(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    history: History,
    prefix: str,
    queue: str,
) -> None:
    """until_executed: 100 delay() calls of one signature give one task id and one run."""
    worker_factory("prefork", 2)
    task = storm_app.tasks[modes.task_name("until_executed")]
    gate = gate_name(prefix)
    ids = {task.delay(7, gate).id for _ in range(100)}
    assert len(ids) == 1
    (task_id,) = ids
    wait_started(db9, prefix, task_id)
    ids |= {task.delay(7, gate).id for _ in range(100)}  # and while it runs
    assert ids == {task_id}
    db9.set(gate, 1)
    assert storm_app.AsyncResult(task_id).get(timeout=20) == 7
    assert [e.task_id for e in history.executions()] == [task_id]
    assert len(starts(db9, prefix)) == 1
    assert not db9.exists(task.lock_key_for(7, gate))


@BOTH_BROKERS
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "attempts"), [("modes.retry", 3), ("modes.autoretry", 2)])
def test_retries_keep_the_lock_until_the_final_attempt(
    name: str,
    attempts: int,
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """until_executed across self.retry()/autoretry: every attempt runs, no duplicate slips in."""
    worker_factory("solo")
    task = storm_app.tasks[name]
    key = task.lock_key_for(3)
    result = task.delay(3)
    samples = []
    while not result.ready():
        # Between attempts (a countdown in the worker's timer) and during them.
        samples.append((holder_of(db9, key), task.delay(3).id, len(starts(db9, prefix))))
        time.sleep(0.02)
    with pytest.raises(ValueError):
        result.get(timeout=5)
    assert [s["retries"] for s in starts(db9, prefix, result.id)] == list(range(attempts))
    # Until the final attempt started, the key named the task and duplicates folded into it.
    before_final = [s for s in samples if s[2] < attempts]
    assert len(before_final) > 10
    assert all(holder == result.id and dup == result.id for holder, dup, _ in before_final)
    # Released after the final failure: the next call is a new task. (A sample
    # taken between the release and the stored result may already be one.)
    newer = {dup for _, dup, _ in samples if dup != result.id}
    assert all(count >= attempts for _, dup, count in samples if dup != result.id)
    assert holder_of(db9, key) in newer | {None}
    assert task.delay(3).id != result.id
    assert not db9.exists(modes.lapsed_key(prefix))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "queued_for"), [("until_executing", 2.0), ("until_and_while_executing", 1.2)]
)
def test_a_retry_meeting_a_newer_copy_still_runs(
    mode: str,
    queued_for: float,
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    history: History,
    prefix: str,
) -> None:
    """A retry published while a newer copy holds the key is never dropped as its duplicate.

    The first call starts, a second one is reserved, then the first retries:
    its retry goes out without a reservation. until_executing: the retry
    comes due while the newer copy still waits, and runs. until_and_while_executing
    (``lock_on_conflict="skip"``): it comes due while the newer copy runs, waits
    for it and runs after it. Either way the first call ends in SUCCESS, its
    link runs, and the newer copy runs too.
    """
    worker_factory("threads", 2)
    task = storm_app.tasks[f"modes.retry_first.{mode}"]
    after = storm_app.tasks["modes.after"]
    gate = gate_name(prefix)
    rkey = reservation_key(mode, task.lock_key_for(1, gate))
    first = task.apply_async((1, gate), link=after.si("linked"))
    wait_started(db9, prefix, first.id)
    second = task.apply_async((1, gate), countdown=queued_for)
    assert second.id != first.id
    assert holder_of(db9, rkey) == second.id
    db9.set(f"{gate}:retry", 1)  # the first call retries now
    retried = time.monotonic()
    # Past the retry's countdown (until_and_while_executing: the newer copy runs by then).
    due = modes.RETRY_FIRST[mode] + 0.5
    while time.monotonic() - retried < due:
        assert first.state != SKIPPED, first.info
        time.sleep(0.05)
    db9.set(gate, 1)
    assert first.get(timeout=20) == 1
    assert second.get(timeout=20) == 1
    assert [s["retries"] for s in starts(db9, prefix, first.id)] == [0, 1]
    assert [s["retries"] for s in starts(db9, prefix, second.id)] == [0]
    wait_until(
        lambda: [s for s in starts(db9, prefix) if s.get("args") == ["linked"]],
        timeout=10,
        message="the first call's link",
    )
    if mode == "until_executing":
        # The retry came due first: it did not wait for the newer copy's turn.
        assert starts(db9, prefix, first.id)[1]["time"] < starts(db9, prefix, second.id)[0]["time"]
    else:
        # It met the running copy, waited, and ran once that one ended.
        history.assert_no_overlap_per_key()
        runs = {(e.task_id, e.start): e for e in history.executions()}
        (newer,) = [e for (task_id, _), e in runs.items() if task_id == second.id]
        assert max(start for task_id, start in runs if task_id == first.id) >= newer.end
    assert not db9.exists(rkey)


@pytest.mark.timeout(60)
def test_a_retry_that_cannot_be_published_gives_the_lock_back(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """until_executed: a failed retry publish hands the lock back to the run, which releases it."""
    worker = worker_factory("solo")
    task = storm_app.tasks["modes.unpublishable_retry"]
    result = task.delay(8)
    wait_until(lambda: result.state == "FAILURE", timeout=15, message="the rejected retry")
    assert len(starts(db9, prefix, result.id)) == 1
    assert not db9.exists(task.lock_key_for(8))
    log = worker.log()
    assert f"[{result.id}]: publish failed; the running attempt keeps" in log
    # Neither the watchdog nor the release found the lock in someone else's hands.
    assert " lost" not in log and "ERROR/" not in log


@BOTH_BROKERS
@pytest.mark.timeout(60)
def test_eta_task_keeps_its_enqueue_lock_until_it_runs(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """An eta 5 s away outlives the 1 s enqueue TTL: the lock lasts countdown + TTL."""
    worker_factory("solo")
    task = storm_app.tasks["modes.eta"]
    key = task.lock_key_for(5)
    published = time.monotonic()
    result = task.apply_async((5,), countdown=5)
    held: list[tuple[float, str | None, str]] = []
    while not starts(db9, prefix, result.id):
        held.append((time.monotonic() - published, holder_of(db9, key), task.delay(5).id))
        time.sleep(0.05)
    assert time.monotonic() - published >= 4.5
    # Judged before the eta only: a sample taken as the run ends (after the
    # loop's last look for its start) may find the lock already released.
    before_eta = [sample for sample in held if sample[0] < 4.8]
    assert before_eta[-1][0] > 4, "sampled until shortly before it ran"
    assert all(holder == result.id and dup == result.id for _, holder, dup in before_eta)
    assert result.get(timeout=10) == 5
    assert not db9.exists(key)
    assert not db9.exists(modes.lapsed_key(prefix))


@pytest.mark.timeout(60)
def test_a_lapsed_enqueue_lock_still_runs_and_says_so(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """A reservation that expired in a backlog: the task runs, with lock_lapsed and a WARNING."""
    task = storm_app.tasks["modes.short_reservation"]
    key = task.lock_key_for(4)
    result = task.delay(4)
    wait_until(lambda: not db9.exists(key), timeout=5, message="the 0.3 s reservation to lapse")
    worker = worker_factory("solo")
    assert result.get(timeout=20) == 4
    lapsed = [json.loads(raw) for raw in db9.lrange(modes.lapsed_key(prefix), 0, -1)]
    assert lapsed == [{"task_id": result.id, "key": key, "mode": "until_executed"}]
    assert f"modes.short_reservation[{result.id}]: its enqueue lock" in worker.log()
    assert "lapsed before it started" in worker.log()
    assert not db9.exists(key)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ENQUEUE_MODES)
def test_a_failed_publish_leaves_no_lock(
    mode: str, storm_env: dict[str, str], db9: redis.Redis, prefix: str
) -> None:
    """The broker refuses the connection: apply_async raises and the reservation is gone."""
    env = dict(storm_env, REDLOCK_TEST_BROKER=f"redis://127.0.0.1:{free_port()}/9")
    app = storm.create_app(env)
    # A short retry policy: give up on the refused broker at once.
    app.conf.broker_connection_timeout = 1
    app.conf.broker_transport_options = {**app.conf.broker_transport_options, "max_retries": 0}
    try:
        task = app.tasks[modes.task_name(mode)]
        with pytest.raises(Exception) as info:
            task.apply_async((1,), retry=False)
        assert not isinstance(info.value, DuplicateTask)
        key = task.lock_key_for(1)
        assert not db9.exists(reservation_key(mode, key)) and not db9.exists(key)
        # And the next attempt is not refused as a duplicate of the failed one.
        with pytest.raises(Exception) as again:
            task.apply_async((1,), retry=False)
        assert type(again.value) is type(info.value)
    finally:
        app.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("policy", "published"), [("requeue", False), ("raise", False), ("run", True)]
)
def test_lock_store_down_at_enqueue(
    policy: str,
    published: bool,
    storm_env: dict[str, str],
    db9: redis.Redis,
    prefix: str,
    queue: str,
) -> None:
    """Redis down at enqueue: a clear LockError and nothing published, unless on_redis_error=run."""
    env = dict(storm_env, REDLOCK_TEST_LOCK_URL=f"redis://127.0.0.1:{free_port()}/9")
    app = storm.create_app(env)
    app.conf.redlock_on_redis_error = policy
    try:
        task = app.tasks[modes.task_name("until_executed")]
        if published:
            result = task.delay(1)
            assert result.id
        else:
            with pytest.raises(LockError, match="was not published: lock store unreachable"):
                task.delay(1)
        assert queued_messages(db9, prefix, queue) == (1 if published else 0)
    finally:
        app.close()


@BOTH_BROKERS
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ENQUEUE_MODES)
def test_revoked_queued_task_frees_its_key(
    mode: str, storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """revoke() of a queued task: the worker discards it and frees its enqueue lock."""
    # One pool process, busy: the main process takes the revoke while the task waits.
    worker_factory("prefork", 1)
    task = storm_app.tasks[modes.task_name(mode)]
    gate = gate_name(prefix)
    busy = task.delay("busy", gate)
    wait_started(db9, prefix, busy.id)
    queued = task.delay("queued")
    key = reservation_key(mode, task.lock_key_for("queued"))
    assert holder_of(db9, key) == queued.id
    replies = storm_app.control.revoke(queued.id, reply=True, timeout=5, limit=1)
    assert replies, "the worker acknowledged the revoke"
    db9.set(gate, 1)
    wait_until(lambda: not db9.exists(key), timeout=15, message=f"{key} to be freed")
    assert busy.get(timeout=10) == "busy"
    assert storm_app.AsyncResult(queued.id).state == "REVOKED"
    assert not starts(db9, prefix, queued.id)
    again = task.delay("queued")
    assert again.id != queued.id
    assert again.get(timeout=20) == "queued"


@BOTH_BROKERS
@pytest.mark.timeout(60)
def test_reject_releases_an_until_executed_lock(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """A task that rejects its message lets go of the lock it held since apply_async."""
    worker_factory("solo")
    task = storm_app.tasks["modes.reject"]
    result = task.delay(6)
    wait_started(db9, prefix, result.id)
    wait_until(lambda: result.state == "FAILURE", timeout=15, message="the rejection")
    assert not db9.exists(task.lock_key_for(6))
    assert task.delay(6).id != result.id


@BOTH_BROKERS
@pytest.mark.timeout(90)
def test_until_and_while_executing_storm(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    history: History,
    prefix: str,
) -> None:
    """200 submissions of a slow task: at most one copy runs and at most one waits, ever."""
    worker_factory("prefork", 2)
    task = storm_app.tasks["modes.storm"]
    first_seen: dict[str, float] = {}
    returned = []
    with storm_app.producer_or_acquire() as producer:
        for _ in range(200):
            task_id = task.apply_async(("s", 0.25), producer=producer).id
            first_seen.setdefault(task_id, time.time())
            returned.append(task_id)
            time.sleep(0.015)
    copies = list(first_seen)  # in publish order
    assert 3 <= len(copies) < 50, copies
    wait_until(
        lambda: len(history.executions()) >= len(copies),
        timeout=40,
        message=lambda: f"{len(copies)} executions, have {len(history.executions())}",
    )
    executions = history.executions()
    assert sorted(e.task_id for e in executions) == sorted(copies), "each copy ran exactly once"
    history.assert_no_overlap_per_key()  # at most one running, by clock and by counter
    preruns: dict[str, float] = {}
    for raw in db9.lrange(modes.prerun_key(prefix), 0, -1):
        record = json.loads(raw)
        preruns[record["task_id"]] = max(record["time"], preruns.get(record["task_id"], 0.0))
    # Copy n+1 was only reserved after copy n handed its reservation over, which
    # happens after copy n's last task_prerun: their waiting times never overlap.
    for before, after in zip(copies, copies[1:]):
        assert preruns[before] < first_seen[after], (before, after)
    assert not db9.exists(modes.lapsed_key(prefix))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["until_executed", "until_and_while_executing"])
def test_send_task_bypass_meets_the_execution_lock(
    mode: str, storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """send_task skips apply_async; the execution lock still stops it while a copy runs.

    until_executed skips it (the default ``lock_on_conflict``);
    until_and_while_executing requeues it by default and runs it afterwards.
    """
    worker_factory("threads", 2)
    name = modes.task_name(mode)
    gate = gate_name(prefix)
    first = storm_app.tasks[name].delay(1, gate)
    wait_started(db9, prefix, first.id)
    bypass = storm_app.send_task(name, (1, gate))
    if mode == "until_executed":
        wait_until(lambda: bypass.state == SKIPPED, timeout=15, message="the bypass skipped")
        assert bypass.info["holder"] == first.id
    db9.set(gate, 1)
    assert first.get(timeout=20) == 1
    if mode == "until_executed":
        assert not starts(db9, prefix, bypass.id)
    else:
        assert bypass.get(timeout=20) == 1
        first_start = starts(db9, prefix, first.id)[0]
        assert starts(db9, prefix, bypass.id)[0]["time"] >= first_start["time"]


@pytest.mark.timeout(60)
def test_send_task_bypass_meets_a_queued_until_executing_copy(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """until_executing: a bypassing message that starts while a copy is queued is a duplicate."""
    name = modes.task_name("until_executing")
    bypass = storm_app.send_task(name, (2,))
    queued = storm_app.tasks[name].delay(2)
    worker_factory("solo")  # runs them in order: the bypass first
    assert queued.get(timeout=20) == 2
    wait_until(lambda: bypass.state == SKIPPED, timeout=15, message="the bypass to be skipped")
    assert bypass.info["holder"] == queued.id
    assert [s["task_id"] for s in starts(db9, prefix)] == [queued.id]


@pytest.mark.timeout(60)
def test_canvas_with_a_duplicate(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    queue: str,
) -> None:
    """A duplicate in a chain or group is refused loudly, never folded and never dropped."""
    task = storm_app.tasks[modes.task_name("until_executed")]  # return_existing
    after = storm_app.tasks["modes.after"]
    gate = gate_name(prefix)
    held = task.delay(1, gate)

    # First step a duplicate: the caller gets DuplicateTask and nothing is sent.
    with pytest.raises(DuplicateTask) as info:
        chain(task.si(1, gate), after.si("first")).apply_async()
    assert info.value.task_id == held.id
    assert queued_messages(db9, prefix, queue) == 1

    # A group holding one signature twice: the first member is sent, the second refused.
    with pytest.raises(DuplicateTask):
        group(task.si(9), task.si(9)).apply_async()
    assert queued_messages(db9, prefix, queue) == 2

    # A later step a duplicate: the step that sends it fails with DuplicateTask.
    worker_factory("threads", 2)
    wait_started(db9, prefix, held.id)
    tail = chain(after.si("head"), task.si(1, gate), after.si("tail")).apply_async()
    head = tail.parent.parent
    with pytest.raises(DuplicateTask):
        head.get(timeout=20)
    assert head.state == "FAILURE"

    # Without a duplicate the chain runs through.
    db9.set(gate, 1)
    assert held.get(timeout=20) == 1
    done = chain(after.si("a"), task.si(2, gate), after.si("b")).apply_async()
    assert done.get(timeout=20) == "after"
    names = [s["name"] for s in starts(db9, prefix)]
    assert names.count("modes.after") == 2 + 1  # "a", "b", and the head of the failed chain
    # Celery fails the rest of the chain with the same error; none of it ran.
    assert tail.state == "FAILURE" and isinstance(tail.result, DuplicateTask)
    assert tail.parent.state == "FAILURE"
    assert not [s for s in starts(db9, prefix) if s.get("args") == ["tail"]]
