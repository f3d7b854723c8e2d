"""Job functions for the RQ tests, run by real ``rq worker`` subprocesses.

Each writes what it saw into Redis on the worker's own connection, which is
the test's private server: the run count, hold intervals and a live-holder
counter that must never exceed one.
"""

from __future__ import annotations

import os
import time

import redis
from rq import get_current_job

from celery_redlock import current_lock, current_rate
from celery_redlock.rq import singleton_job

RUNS = "jobs:runs"
RELEASE = "jobs:release"
LOG = "jobs:log"
HOLDERS = "jobs:holders"
PID = "jobs:pid"
#: Environment variable naming the lock store of ``locked_elsewhere`` (a worker's setting).
LOCK_STORE_ENV = "REDLOCK_TEST_RQ_LOCK_STORE"


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


@singleton_job(ttl=60, on_conflict="raise")
def fails_first(item):
    """Fail on the first run, succeed on the next; the TTL outlives every test."""
    connection = _connection()
    if connection.incr(RUNS) == 1:
        raise ValueError(f"the first run of {item} fails")
    return f"ran {item}"


@singleton_job(ttl=60, on_conflict="skip", skipped="SKIPPED")
def dies_holding(item):
    """The first run records its process id and holds the lock until the test kills it.

    Later runs count and return. The TTL outlives the test: the dead run's lock
    is gone only when the test deletes it.
    """
    connection = _connection()
    if connection.incr(RUNS) == 1:
        connection.set(PID, os.getpid())
        _wait_for_release(connection)
    return f"ran {item}"


def _lock_store():
    url = os.environ.get(LOCK_STORE_ENV)
    if url is None:
        return None  # the worker's own connection (the test process only enqueues)
    return redis.Redis.from_url(url, socket_timeout=0.2, socket_connect_timeout=0.2)


@singleton_job(on_redis_error="requeue", max_requeues=0, client=_lock_store())
def locked_elsewhere():
    """Lock on the server ``$REDLOCK_TEST_RQ_LOCK_STORE`` names, not the queue's."""
    _connection().incr(RUNS)
    return "ran"


#: The hold intervals of ``limited`` (``start:end:holders:fence:slot``).
LIMITED_LOG = "jobs:limited"
LIMITED_HOLDERS = "jobs:limited_holders"


@singleton_job(
    ttl=5,
    limit=2,
    on_conflict="requeue",
    requeue_delay=1,
    requeue_max_delay=2,
    max_requeues=1000,
)
def limited(item, seconds=0.3):
    """Hold one of two permits for ``seconds``, recording how many runs were inside."""
    connection = _connection()
    lease = current_lock()
    start = time.time()
    holders = connection.incr(LIMITED_HOLDERS)
    time.sleep(seconds)
    connection.decr(LIMITED_HOLDERS)
    end = time.time()
    connection.rpush(LIMITED_LOG, f"{start}:{end}:{holders}:{lease.fence}:{lease.slot}")
    return item


#: ``item:ms``: the server time at which each ``rated`` run was admitted.
RATED_LOG = "jobs:rated"


@singleton_job(ttl=5, key="item", rate="2/2s", rate_key=[], on_conflict="requeue")
def rated(item):
    """Record the server time of this run's admission to the shared rate key (2 per 2 s)."""
    _connection().rpush(RATED_LOG, f"{item}:{current_rate().verdict.at_ms}")
    return item


@singleton_job(ttl=5, key="item", rate="1/m", rate_key=[], skipped="SKIPPED")
def rated_or_skipped(item):
    """One run a minute across every item; the others are skipped."""
    return item
