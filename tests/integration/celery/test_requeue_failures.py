"""A duplicate whose requeue cannot be published is neither lost nor failed for a bad reason.

The workers here consume from the broker but publish to ``broker_write_url``,
an address where nothing listens, so every requeue fails the way it does
while a broker connection is being re-established.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_redlock import LockError
from tests.celery_apps import storm
from tests.celery_harness import REDIS_URL, Broker, History, wait_until
from tests.integration.celery.conftest import WorkerFactory
from tests.redis_servers import free_port


@pytest.fixture
def storm_env(broker: Broker, prefix: str, queue: str, acks_late: bool) -> dict[str, str]:
    """The storm app's environment, publishing to a closed port."""
    env = storm.environment(
        broker=broker.url,
        backend=REDIS_URL,
        lock_url=REDIS_URL,
        prefix=prefix,
        queue=queue,
        acks_late=acks_late,
    )
    env["REDLOCK_TEST_BROKER_WRITE"] = f"redis://127.0.0.1:{free_port()}/9"
    return env


@pytest.fixture
def storm_app(storm_env: dict[str, str], db9: redis.Redis) -> Iterator[Celery]:
    """The test's own app publishes to the real broker."""
    env = {k: v for k, v in storm_env.items() if k != "REDLOCK_TEST_BROKER_WRITE"}
    app = storm.create_app(env)
    try:
        yield app
    finally:
        app.close()


def start_duplicate(
    storm_app: Celery, worker_factory: WorkerFactory, history: History, gate: str
) -> tuple[str, str]:
    """Run one call holding its lock until ``gate``, then send a duplicate that meets it."""
    worker = worker_factory("threads", 2)
    task = storm_app.tasks["storm.hold_requeue"]
    first = task.delay(1, 0, gate)
    key = task.lock_key_for(1, 0, gate)
    wait_until(lambda: history.running(key) == 1, 20, message="the first call to hold the lock")
    duplicate = task.delay(1, 0, gate)
    wait_until(
        lambda: any(
            f"[{duplicate.id}]: " in line and line.endswith("; requeue")
            for line in worker.log().splitlines()
        ),
        30,
        message="the duplicate to meet the lock",
    )
    return first.id, duplicate.id


@pytest.mark.parametrize("acks_late", [True], ids=["acks_late"])
@pytest.mark.timeout(60)
def test_acks_late_duplicate_is_redelivered_and_runs(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """acks_late: the message goes back to the broker and the call runs once the lock is free."""
    gate = f"{prefix}:gate"
    first, duplicate = start_duplicate(storm_app, worker_factory, history, gate)
    db9.set(gate, 1)
    assert storm_app.AsyncResult(first).get(timeout=20) == 1
    assert storm_app.AsyncResult(duplicate).get(timeout=30) == 1
    assert sorted(e.task_id for e in history.executions()) == sorted([first, duplicate])
    history.assert_no_overlap_per_key()


@pytest.mark.timeout(60)
def test_early_ack_duplicate_fails_naming_the_lock(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """Early ack: the message is gone, so the call fails, saying it could not be requeued."""
    gate = f"{prefix}:gate"
    first, duplicate = start_duplicate(storm_app, worker_factory, history, gate)
    result = storm_app.AsyncResult(duplicate)
    with pytest.raises(LockError, match="could not requeue for lock"):
        result.get(timeout=20)
    db9.set(gate, 1)
    assert storm_app.AsyncResult(first).get(timeout=20) == 1
