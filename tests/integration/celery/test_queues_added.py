"""Per-queue locking of queues a worker starts consuming at runtime (``add_consumer``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from celery import Celery

from tests.celery_harness import CeleryWorker, History, wait_until
from tests.integration.celery.conftest import WorkerFactory
from tests.integration.celery.test_queues import assert_duplicates_skipped
from tests.integration.celery.test_queues_spawn import spawning_worker


@pytest.fixture
def locked_queue(queue: str) -> str:
    """A queue named in redlock_queues that the workers do not consume at start."""
    return f"{queue}.locked"


@pytest.fixture
def storm_env(storm_env: dict[str, str], locked_queue: str) -> dict[str, str]:
    """The storm app's environment, with ``locked_queue`` in redlock_queues."""
    return {**storm_env, "REDLOCK_TEST_QUEUES": json.dumps([locked_queue])}


def control(app: Celery, worker: CeleryWorker, command: str, queue: str, **options: Any) -> None:
    """Send ``add_consumer`` or ``cancel_consumer`` to ``worker`` and wait for its answer."""
    replies = getattr(app.control, command)(
        queue, destination=[worker.nodename], reply=True, timeout=5, **options
    )
    assert [worker.nodename] == [name for reply in replies for name in reply], replies


def wait_for_log(worker: CeleryWorker, line: str, count: int = 1) -> None:
    """Wait until ``line`` appears ``count`` times in the worker's log."""
    wait_until(
        lambda: worker.log().count(line) >= count,
        20,
        message=lambda: f"{count} x {line!r} in the log\n{worker.log_tail()}",
    )


def add_queue(app: Celery, worker: CeleryWorker, queue: str, count: int = 1) -> None:
    """Make ``worker`` consume ``queue`` (for the ``count``-th time) and wait until it does."""
    control(app, worker, "add_consumer", queue)
    wait_for_log(worker, f"Started consuming from {queue}", count)


@pytest.mark.timeout(150)
def test_a_locked_queue_added_at_runtime_is_locked_and_again_after_re_adding(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    queue: str,
    locked_queue: str,
    prefix: str,
) -> None:
    """add_consumer of a redlock_queues queue on a forking prefork worker: duplicates skip.

    The worker consumed no locked queue at start, and its pool processes were
    forked before the add; after cancel_consumer and a second add it is still
    locked.
    """
    worker = worker_factory("prefork", 2, queues=[queue])
    add_queue(storm_app, worker, locked_queue)
    assert_duplicates_skipped(storm_app, history, db9, locked_queue, f"{prefix}:gate1", x=1)
    control(storm_app, worker, "cancel_consumer", locked_queue)
    wait_for_log(worker, f"Canceling queue {locked_queue}")
    add_queue(storm_app, worker, locked_queue, count=2)
    assert_duplicates_skipped(storm_app, history, db9, locked_queue, f"{prefix}:gate2", x=2)
    assert len(history.executions()) == 2
    history.assert_no_overlap_per_key()


@pytest.mark.timeout(150)
def test_spawned_pool_processes_lock_a_queue_added_at_runtime(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    queue: str,
    locked_queue: str,
    prefix: str,
) -> None:
    """worker_pool_start_method='spawn': a redlock_queues queue added later is locked too."""
    settings = {"worker_pool_start_method": "spawn", "redlock_stats": False}
    worker = spawning_worker(worker_factory, [queue], settings)
    add_queue(storm_app, worker, locked_queue)
    assert_duplicates_skipped(storm_app, history, db9, locked_queue, f"{prefix}:gate")


@pytest.mark.timeout(90)
def test_a_locked_queue_added_with_an_unknown_binding_is_refused(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    queue: str,
    locked_queue: str,
) -> None:
    """add_consumer of a locked queue on a binding the pool cannot recognise: ERROR, not consumed.

    Its deliveries could not be told apart by the pool processes, so consuming
    it would run its tasks without a lock.
    """
    worker = worker_factory("solo", 1, queues=[queue])
    control(
        storm_app,
        worker,
        "add_consumer",
        locked_queue,
        exchange=f"{locked_queue}.elsewhere",
        routing_key="elsewhere",
    )
    wait_for_log(worker, f"celery-redlock: not consuming from queue {locked_queue!r}")
    (replies,) = storm_app.control.inspect([worker.nodename], timeout=5).active_queues().values()
    assert [q["name"] for q in replies] == [queue]
    assert f"Started consuming from {locked_queue}" not in worker.log()
