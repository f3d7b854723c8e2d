"""Per-queue locking in a prefork worker whose pool spawns its processes instead of forking."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import redis
from celery import Celery

from celery_redlock.celery.bootsteps import SPAWN_STATS_WARNING
from tests.celery_harness import CeleryWorker, History
from tests.integration.celery.conftest import WorkerFactory
from tests.integration.celery.test_queues import assert_duplicates_skipped

DUPLICATES = 3


@pytest.fixture
def locked_queue(queue: str) -> str:
    """A second queue of the test, the one locking applies to."""
    return f"{queue}.locked"


def spawning_worker(
    worker_factory: WorkerFactory,
    queues: Sequence[str],
    settings: dict[str, object],
    extra_args: Sequence[str] = (),
) -> CeleryWorker:
    """Start a prefork -c 2 worker with ``settings`` applied last (on top of the test's)."""
    worker_factory.env = {**worker_factory.env, "REDLOCK_TEST_SETTINGS": json.dumps(settings)}
    return worker_factory("prefork", 2, queues=list(queues), extra_args=extra_args)


@pytest.mark.timeout(120)
def test_spawned_pool_processes_lock_a_configured_queue(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    queue: str,
    locked_queue: str,
    prefix: str,
) -> None:
    """worker_pool_start_method='spawn': duplicates from a redlock_queues queue are skipped."""
    settings = {
        "worker_pool_start_method": "spawn",
        "redlock_queues": {locked_queue: {"ttl": 5}},
        "redlock_stats": False,
    }
    spawning_worker(worker_factory, [queue, locked_queue], settings)
    assert_duplicates_skipped(
        storm_app, history, db9, locked_queue, f"{prefix}:gate", duplicates=DUPLICATES
    )


@pytest.mark.timeout(120)
def test_spawned_pool_processes_lock_a_queue_named_on_the_command_line(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    queue: str,
    locked_queue: str,
    prefix: str,
) -> None:
    """--pool-start-method=spawn --redlock-queues=Q (no setting): Q's duplicates are skipped.

    The option's value exists only in the worker's main process: the spawned
    processes must be handed it.
    """
    spawning_worker(
        worker_factory,
        [queue, locked_queue],
        {"redlock_stats": False},
        extra_args=["--pool-start-method=spawn", f"--redlock-queues={locked_queue}"],
    )
    assert_duplicates_skipped(
        storm_app, history, db9, locked_queue, f"{prefix}:gate", duplicates=DUPLICATES
    )


@pytest.mark.timeout(120)
def test_a_spawning_worker_says_once_that_it_counts_nothing(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    queue: str,
    locked_queue: str,
    prefix: str,
) -> None:
    """Under spawn the counters are off: one WARNING at start, and redlock_stats says why.

    It must not answer with zeros that look like nothing was locked.
    """
    settings = {"worker_pool_start_method": "spawn", "redlock_queues": [locked_queue]}
    worker = spawning_worker(worker_factory, [queue, locked_queue], settings)
    assert_duplicates_skipped(
        storm_app, history, db9, locked_queue, f"{prefix}:gate", duplicates=DUPLICATES
    )
    assert worker.log().count(SPAWN_STATS_WARNING) == 1
    (reply,) = storm_app.control.broadcast(
        "redlock_stats", reply=True, destination=[worker.nodename], timeout=5
    )
    assert reply[worker.nodename] == {"error": f"celery-redlock: {SPAWN_STATS_WARNING}"}
