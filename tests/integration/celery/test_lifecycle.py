"""Outcomes that need a real pool child to time out, be revoked, or die, on prefork workers."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from tests.celery_apps.storm import started_key
from tests.celery_harness import History, wait_until
from tests.integration.celery.conftest import WorkerFactory


def started(db9: redis.Redis, prefix: str, task_id: str) -> list[dict[str, Any]]:
    """The start announcements of ``task_id``, oldest first."""
    records = [json.loads(raw) for raw in db9.lrange(started_key(prefix), 0, -1)]
    return [record for record in records if record["task_id"] == task_id]


def wait_started(db9: redis.Redis, prefix: str, task_id: str, count: int = 1) -> dict[str, Any]:
    wait_until(
        lambda: len(started(db9, prefix, task_id)) >= count,
        timeout=20,
        message=f"task {task_id} did not start {count} time(s)",
    )
    return started(db9, prefix, task_id)[count - 1]


def deleted_before_expiry(
    db9: redis.Redis, key: str, action: Callable[[], object], timeout: float = 30
) -> None:
    """Run ``action``, then wait until ``key`` is gone; fail unless it was deleted with TTL left.

    ``key``'s expiry is read once before ``action`` (which may release it at
    once) and again on every poll. Both ends are read on the Redis server's
    clock (``TIME`` beside each ``PTTL``), so a slow test process cannot
    mistake an expiry for a release.
    """
    expires_ms: list[int] = []

    def gone() -> bool:
        pipe = db9.pipeline(transaction=True)
        pipe.pttl(key)
        pipe.time()
        ttl, (seconds, micros) = pipe.execute()
        now_ms = seconds * 1000 + micros // 1000
        if ttl >= 0:
            expires_ms.append(now_ms + ttl)
            return False
        assert expires_ms, f"{key} was not held when the watch began"
        assert now_ms < expires_ms[-1], f"{key} ran out its TTL instead of being released"
        return True

    assert not gone()
    action()
    wait_until(gone, timeout=timeout, interval=0.02, message=f"{key} to be released")


def expire_unrenewed(db9: redis.Redis, key: str, timeout: float = 30) -> list[int]:
    """Watch ``key``'s TTL until the key is gone; fail if anything renewed it meanwhile.

    Returns the TTLs (ms) seen. A lock whose holder died must run out on its
    own: its TTL only falls. A renewal (a watchdog outliving its task) would
    raise it again.
    """
    seen: list[int] = []

    def gone() -> bool:
        ttl = int(db9.pttl(key))
        if ttl < 0:
            return True
        seen.append(ttl)
        return False

    wait_until(gone, timeout=timeout, interval=0.02, message=f"{key} to expire")
    assert seen == sorted(seen, reverse=True), f"{key} was renewed after its holder died: {seen}"
    return seen


@pytest.mark.timeout(60)
def test_soft_time_limit_releases_at_once(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """A soft time limit unwinds the task and releases its lock, long before its 30 s TTL."""
    worker_factory("prefork", 2)
    task = storm_app.tasks["storm.soft_limited"]
    result = task.delay(3)
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=20)
    assert not db9.exists(task.lock_key_for(3))


@pytest.mark.timeout(60)
def test_revoke_with_terminate_releases_and_a_duplicate_then_runs(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """revoke(terminate=True) frees the lock well inside its 10 s TTL; the next call runs."""
    worker_factory("prefork", 2)
    task = storm_app.tasks["storm.hold"]
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    first = task.delay(1, 0, gate)
    wait_started_via_lock(db9, task.lock_key_for(1, 0, gate))
    deleted_before_expiry(
        db9,
        task.lock_key_for(1, 0, gate),
        lambda: storm_app.control.revoke(first.id, terminate=True),
    )
    db9.set(gate, 1)
    assert task.delay(1, 0, gate).get(timeout=20) == 1


@pytest.mark.timeout(60)
def test_revoke_with_sigkill_releases_from_the_main_process(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """A child killed by revoke(signal=SIGKILL) cannot release; its worker does, at once."""
    worker = worker_factory("prefork", 2)
    task = storm_app.tasks["storm.hold"]
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    key = task.lock_key_for(1, 0, gate)
    first = task.delay(1, 0, gate)
    wait_started_via_lock(db9, key)
    storm_app.control.revoke(first.id, terminate=True, signal="SIGKILL")
    # The worker says it released the lock, and the key is gone: a lock left
    # to expire (10 s TTL) would be gone too, but never with that line.
    released = f"task storm.hold[{first.id}] was killed; released its lock"
    wait_until(lambda: released in worker.log(), timeout=8, message="the release by the worker")
    assert not db9.exists(key)
    db9.set(gate, 1)
    assert task.delay(1, 0, gate).get(timeout=20) == 1


def wait_started_via_lock(db9: redis.Redis, key: str) -> None:
    wait_until(lambda: db9.exists(key), timeout=20, message=f"nobody took {key}")


@pytest.mark.timeout(60)
def test_hard_time_limit_frees_the_lock_within_its_ttl(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """A child killed by the hard time limit leaves a lock that expires within lock_ttl."""
    worker_factory("prefork", 2)
    task = storm_app.tasks["storm.hard_limited"]
    result = task.delay(10)
    wait_started(db9, prefix, result.id)
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=20)
    # Killed at 1 s: nothing renews the 2 s lock after that, and it runs out.
    expire_unrenewed(db9, task.lock_key_for(10))
    again = task.delay(10)
    wait_started(db9, prefix, again.id)  # the duplicate is not skipped: it runs


@pytest.mark.timeout(60)
def test_sigkill_of_the_child_frees_the_lock_within_its_ttl(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """SIGKILL mid-run: renewals die with the child, the lock expires, a later call runs."""
    worker_factory("prefork", 2)
    task = storm_app.tasks["storm.mortal_early"]
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    first = task.delay(1, gate)
    victim = wait_started(db9, prefix, first.id)
    key = task.lock_key_for(1, gate)
    assert db9.exists(key)
    os.kill(victim["pid"], signal.SIGKILL)
    assert expire_unrenewed(db9, key)[0] <= 2000  # lock_ttl is 2 s; no renewal after the kill
    db9.set(gate, 1)
    assert task.delay(1, gate).get(timeout=20) == 1


@pytest.mark.timeout(90)
def test_redelivery_after_sigkill_waits_for_the_dead_holder_then_runs(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    history: History,
) -> None:
    """acks_late + a killed child: the redelivered copy meets its own lock, waits, and runs.

    It must neither be skipped (the task would be lost) nor run while the dead
    copy's lock is still valid.
    """
    worker = worker_factory("prefork", 2)
    task = storm_app.tasks["storm.mortal"]
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    result = task.delay(1, gate)
    victim = wait_started(db9, prefix, result.id)
    key = task.lock_key_for(1, gate)
    lock_ttl_left = db9.pttl(key) / 1000
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    db9.set(gate, 1)
    assert result.get(timeout=40) == 1
    second = wait_started(db9, prefix, result.id, count=2)
    assert second["pid"] != victim["pid"]
    # The redelivered copy started only once the dead copy's lock had expired.
    assert second["time"] >= killed_at + lock_ttl_left - 0.2
    assert second["fence"] > victim["fence"]
    (execution,) = history.executions()  # only the second copy finished
    assert execution.task_id == result.id
    # It met its own task id as the holder, and was requeued rather than skipped.
    assert f"[{result.id}]: task {result.id} (on " in worker.log()
    assert "; requeue" in worker.log()


@pytest.mark.timeout(90)
def test_duplicate_delivery_while_the_first_runs_elsewhere_never_runs(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    history: History,
) -> None:
    """A second delivery of a running task id waits, then is dropped once the first succeeded."""
    first_worker, second_worker = worker_factory.start(
        worker_factory.create("prefork", 2), worker_factory.create("solo", 1)
    )
    task = storm_app.tasks["storm.mortal"]
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    result = task.delay(1, gate)
    wait_started(db9, prefix, result.id)
    # What the broker does on a redelivery: the same message (same id) again.
    task.apply_async((1, gate), task_id=result.id)
    logs = lambda: first_worker.log() + second_worker.log()  # noqa: E731
    wait_until(
        lambda: f"[{result.id}]: task {result.id} (on " in logs(),
        timeout=20,
        message="the second delivery never met its own lock",
    )
    db9.set(gate, 1)
    assert result.get(timeout=20) == 1
    wait_until(
        lambda: "an earlier delivery already ran it" in logs(),
        timeout=20,
        message="the second delivery was not dropped",
    )
    assert len(started(db9, prefix, result.id)) == 1
    assert len(history.executions()) == 1
