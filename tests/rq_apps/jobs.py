"""Job functions for the RQ tests, run by real ``rq worker`` subprocesses.

Each writes what it saw into Redis on the worker's own connection, which is
the test's private server: the run count, hold intervals and a live-holder
counter that must never exceed one.
"""

from __future__ import annotations

import time

from rq import get_current_job

from celery_redlock import current_lock
from celery_redlock.rq import singleton_job

RUNS = "jobs:runs"
RELEASE = "jobs:release"
LOG = "jobs:log"
HOLDERS = "jobs:holders"


def _connection():
    job = get_current_job()
    assert job is not None
    return job.connection


def _wait_for_release(connection, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not connection.exists(RELEASE):
        if time.monotonic() > deadline:
            raise TimeoutError("the test never released the job")
        time.sleep(0.01)


@singleton_job(ttl=5, on_conflict="skip", skipped="SKIPPED")
def held_until_released(item):
    """Count the run, then hold the lock until the test sets RELEASE."""
    connection = _connection()
    connection.incr(RUNS)
    _wait_for_release(connection)
    return f"ran {item}"


@singleton_job(ttl=5, on_conflict="raise")
def held_or_fail(item):
    """Like held_until_released, but duplicates fail with LockNotAcquired."""
    connection = _connection()
    connection.incr(RUNS)
    _wait_for_release(connection)
    return f"ran {item}"


@singleton_job(
    ttl=5,
    on_conflict="requeue",
    requeue_delay=1,
    requeue_max_delay=2,
    requeue_jitter=0.5,
    max_requeues=1000,
)
def serial(item):
    """Record a short hold interval, proving no other run holds the lock meanwhile."""
    connection = _connection()
    start = time.time()
    holders = connection.incr(HOLDERS)
    time.sleep(0.02)
    connection.decr(HOLDERS)
    end = time.time()
    connection.rpush(LOG, f"{start}:{end}:{holders}:{current_lock().fence}")
    return item
