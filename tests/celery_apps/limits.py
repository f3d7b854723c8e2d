"""Tasks of the N-at-once tests (tests/integration/celery/test_limits.py).

Registered on the storm app by :func:`register`. Every task takes a permit of a
3-permit semaphore keyed by its ``group`` argument, pushes a start record
(task id, pid, fence, slot, time) to :func:`started_key` when its body begins
(so a test can find and kill the process holding a permit), and writes the
usual history record (see :func:`tests.celery_harness.record_execution`) with
its slot when it ends.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task

from celery_redlock import SingletonTask, current_lock
from tests.celery_harness import record_execution, wait_for_gate

__all__ = ["LIMIT", "LIMIT_TTL", "register", "started", "started_key"]

#: Permits per key of every task here.
LIMIT = 3
#: TTL of the permits: short, so a killed holder's permit frees quickly.
LIMIT_TTL = 2.0
GATE_TIMEOUT = 60.0

_clients: dict[str, redis.Redis] = {}

_OPTIONS: dict[str, Any] = {
    "base": SingletonTask,
    "bind": True,
    # shared=False: a shared task would be added to every app created later.
    "shared": False,
    "lock_key": ["group"],
    "lock_limit": LIMIT,
    "lock_ttl": LIMIT_TTL,
}
_REQUEUE: dict[str, Any] = {
    "lock_on_conflict": "requeue",
    "lock_requeue_delay": 0.05,
    "lock_requeue_max_delay": 0.5,
    "lock_max_requeues": 100000,
}


def started_key(prefix: str) -> str:
    """The list of start records of this test's limited tasks."""
    return f"{prefix}:limits:started"


def started(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every start record so far, in push order."""
    return [json.loads(raw) for raw in client.lrange(started_key(prefix), 0, -1)]


def _client(task: Task) -> redis.Redis:
    url = task.app.conf.redlock_url
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url)
    return client


def _run(task: Task, seconds: float, gate: str | None) -> dict[str, Any]:
    lease: Any = current_lock()
    if lease is None:
        raise RuntimeError(f"{task.name} runs without its permit")
    client = _client(task)
    prefix = task.app.conf.redlock_key_prefix
    start = {"task_id": task.request.id, "pid": os.getpid(), "time": time.time()}
    start.update(fence=lease.fence, slot=lease.slot, key=lease.name)
    client.rpush(started_key(prefix), json.dumps(start))
    with record_execution(
        client,
        prefix,
        task_id=task.request.id,
        name=task.name,
        lease=lease,
        hostname=task.request.hostname,
    ) as recorder:
        recorder.extra["slot"] = lease.slot
        time.sleep(seconds)
        if not wait_for_gate(client, gate, GATE_TIMEOUT):
            recorder.extra["gate_timeout"] = True
    return {"fence": lease.fence, "slot": lease.slot}


def register(app: Celery) -> None:
    """Register the limited tasks on ``app``."""

    @app.task(name="limits.skip", **_OPTIONS)
    def skip(self: Task, group: str, seconds: float, gate: str | None = None) -> Any:
        """Run under one of three permits per group; the fourth call at once is skipped."""
        return _run(self, seconds, gate)

    @app.task(name="limits.requeue", **_OPTIONS, **_REQUEUE)
    def requeue(self: Task, group: str, seconds: float, gate: str | None = None) -> Any:
        """As ``skip``, but the call beyond the limit is requeued until a permit frees."""
        return _run(self, seconds, gate)

    @app.task(
        name="limits.mortal",
        acks_late=True,
        reject_on_worker_lost=True,
        **_OPTIONS,
        **_REQUEUE,
    )
    def mortal(self: Task, group: str, seconds: float, gate: str | None = None) -> Any:
        """As ``requeue``, acked late: a killed run's message goes back to the queue."""
        return _run(self, seconds, gate)

    @app.task(name="limits.lasting", **{**_OPTIONS, "lock_ttl": None})
    def lasting(self: Task, group: str, seconds: float, gate: str | None = None) -> Any:
        """As ``skip``, under the app's ``redlock_ttl``: a killed holder's permit lasts."""
        return _run(self, seconds, gate)

    @app.task(
        name="limits.few_requeues",
        **{
            **_OPTIONS,
            **_REQUEUE,
            "lock_requeue_delay": 1.0,
            "lock_requeue_max_delay": 60.0,
            "lock_max_requeues": 3,
        },
    )
    def few_requeues(self: Task, group: str, seconds: float, gate: str | None = None) -> Any:
        """As ``requeue``, but with the default backoff and at most 3 requeues."""
        return _run(self, seconds, gate)
