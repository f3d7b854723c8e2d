"""What the tasks did, kept in Redis so the driver can read it from another process.

Each run appends one JSON record to ``<prefix>:journal`` when it ends; lock
contention (a skip or a requeue) appends one to ``<prefix>:events``. Times
come from the Redis server's clock (``TIME``), the one clock that the worker's
processes and the driver share.

A run also increments ``<prefix>:running:<lock key>`` before it takes its start
time and decrements it after its end time. The value it saw (``holders``) is 1
exactly when no other run of the same key was in progress: Redis counts the
overlap, so the check does not depend on comparing timestamps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import redis


def journal_key(prefix: str) -> str:
    """The list of run records."""
    return f"{prefix}:journal"


def events_key(prefix: str) -> str:
    """The list of contention events."""
    return f"{prefix}:events"


def running_key(prefix: str, key: str) -> str:
    """The counter of runs of lock key ``key`` in progress."""
    return f"{prefix}:running:{key}"


def server_time(client: redis.Redis) -> float:
    """The Redis server's clock, in seconds."""
    seconds, microseconds = client.time()
    return seconds + microseconds / 1_000_000


@dataclass(frozen=True)
class Run:
    """One execution of a task body, under its lock.

    Attributes:
        task: The task's short name, e.g. ``"sync_invoices"``.
        task_id: The Celery task id.
        args: The positional arguments.
        key: The lock key held (``current_lock().name``), or, for a task that
            runs without a lock (``until_executing``), the key it reserved by.
        fence: The fence of that hold; ``None`` when the run held no lock.
        pid: The pool process that ran it.
        start: Start, by the Redis clock.
        end: End, by the Redis clock.
        holders: Runs of this key in progress at the start, this one included.
        outcome: What the task added about its result.
    """

    task: str
    task_id: str
    args: list[Any]
    key: str
    fence: int | None
    pid: int
    start: float
    end: float
    holders: int
    outcome: dict[str, Any] = field(default_factory=dict)


@contextmanager
def recorded_run(
    client: redis.Redis,
    prefix: str,
    *,
    task: str,
    task_id: str,
    args: list[Any],
    key: str,
    fence: int | None,
) -> Iterator[dict[str, Any]]:
    """Record the run of the ``with`` body; the yielded dict becomes its ``outcome``."""
    running = running_key(prefix, key)
    holders = int(client.incr(running))
    start = server_time(client)
    outcome: dict[str, Any] = {}
    try:
        yield outcome
    finally:
        end = server_time(client)
        client.decr(running)
        run = Run(
            task=task,
            task_id=task_id,
            args=args,
            key=key,
            fence=fence,
            pid=os.getpid(),
            start=start,
            end=end,
            holders=holders,
            outcome=outcome,
        )
        client.rpush(journal_key(prefix), json.dumps(asdict(run)))


def record_event(client: redis.Redis, prefix: str, **event: Any) -> None:
    """Append a contention event (task, task id, action, attempt, ...)."""
    client.rpush(events_key(prefix), json.dumps({**event, "pid": os.getpid()}))


def read_runs(client: redis.Redis, prefix: str) -> list[Run]:
    """Every run recorded so far, ordered by start."""
    runs = [Run(**json.loads(item)) for item in client.lrange(journal_key(prefix), 0, -1)]
    return sorted(runs, key=lambda run: run.start)


def read_events(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every contention event so far, in the order they happened."""
    return [json.loads(item) for item in client.lrange(events_key(prefix), 0, -1)]
