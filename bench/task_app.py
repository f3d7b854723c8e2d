"""The Celery app of the task-throughput benchmark (``bench/task_bench.py``).

``python -m celery -A bench.task_app worker ...`` builds it from the
environment, and the benchmark process imports the same module (with the same
environment) to publish, so task names and settings agree on both sides:

``BENCH_TASK_BROKER``
    Redis URL of the benchmark's private broker, also the result backend.
``BENCH_TASK_LOCK_URL``
    Redis URL of the private lock store shared by every contender:
    ``redlock_url`` of ``SingletonTask``, ``ONCE['settings']['url']`` of
    celery-once and ``singleton_backend_url`` of celery-singleton.

Tasks, one per contender, each returning its argument:

``bench.plain``
    A plain ``@app.task``.
``bench.redlock``
    ``base=celery_redlock.SingletonTask`` (locks in the worker, around the body).
``bench.once``
    ``base=celery_once.QueueOnce`` (locks at publish, unlocks after the run).
``bench.singleton``
    ``base=celery_singleton.Singleton`` (locks at publish, unlocks on success/failure).

plus ``bench.hold``, the ``SingletonTask`` of the duplicate storm: it holds its
lock until the benchmark sets a stop key on the *broker* Redis, so its waiting
adds nothing to the lock store's command counts.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery
from celery_once import QueueOnce  # type: ignore[import-untyped]
from celery_singleton import Singleton  # type: ignore[import-untyped]

from celery_redlock import SingletonTask

__all__ = ["HOLD_TTL", "app", "hold", "once", "plain", "redlock", "singleton", "stop_key"]

#: Lock TTL of ``bench.hold``: long enough that no watchdog renewal (at a third
#: of it) happens during a storm, so the storm's counts hold acquires only.
HOLD_TTL = 120.0
#: Interval at which ``bench.hold`` checks its stop key.
HOLD_POLL_SECONDS = 0.01

BROKER_URL = os.environ.get("BENCH_TASK_BROKER", "redis://127.0.0.1:1/0")
LOCK_URL = os.environ.get("BENCH_TASK_LOCK_URL", "redis://127.0.0.1:1/0")

app = Celery("task_bench", set_as_current=True)
app.conf.update(
    broker_url=BROKER_URL,
    result_backend=BROKER_URL,
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # celery-redlock
    redlock_url=LOCK_URL,
    # celery-singleton
    singleton_backend_url=LOCK_URL,
)
# celery-once reads its (upper-case) ONCE setting.
app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": LOCK_URL, "default_timeout": 60},
}

_broker_client: redis.Redis | None = None


def stop_key(tag: str) -> str:
    """Return the broker-Redis key whose existence ends ``bench.hold(tag, ...)``."""
    return f"task_bench:stop:{tag}"


@app.task(name="bench.plain")  # type: ignore[untyped-decorator]
def plain(i: int) -> int:
    """Return ``i``: the baseline, no lock."""
    return i


@app.task(name="bench.redlock", base=SingletonTask)  # type: ignore[untyped-decorator]
def redlock(i: int) -> int:
    """Return ``i`` under celery-redlock's lock."""
    return i


@app.task(name="bench.once", base=QueueOnce, once={"graceful": True})  # type: ignore[untyped-decorator]
def once(i: int) -> int:
    """Return ``i`` under celery-once's publish-time lock."""
    return i


@app.task(name="bench.singleton", base=Singleton)  # type: ignore[untyped-decorator]
def singleton(i: int) -> int:
    """Return ``i`` under celery-singleton's publish-time lock."""
    return i


@app.task(name="bench.hold", base=SingletonTask, lock_ttl=HOLD_TTL)  # type: ignore[untyped-decorator]
def hold(tag: str, max_seconds: float) -> float:
    """Hold the lock of ``(tag, max_seconds)`` until the stop key appears; return the wait."""
    global _broker_client
    if _broker_client is None:
        _broker_client = redis.Redis.from_url(BROKER_URL)
    started = time.monotonic()
    key = stop_key(tag)
    while time.monotonic() - started < max_seconds:
        if _broker_client.exists(key):
            break
        time.sleep(HOLD_POLL_SECONDS)
    return time.monotonic() - started
