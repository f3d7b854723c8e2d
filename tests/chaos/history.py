"""What a chaos-test execution writes while it runs, and the fenced store it writes to.

Imported by worker processes as well as by the tests, so it depends on
nothing but redis-py.

Everything lives in one Redis that no fault touches (db 9 of the shared
server), under the key prefix of one scenario run:

``<run>:executions``
    List of execution ids, pushed when an execution starts.
``<run>:execution:<id>``
    Hash of one execution: task id, lock key, fence, pid, wall-clock start,
    ``valid_until`` (the latest end of validity the holder saw while it still
    believed it held the lock), ``invalid_at`` (when it first saw the lease
    lost or expired), ``lost``, ``end`` and its fenced writes (JSON). A SIGKILLed
    execution has no ``end``.
``<run>:store:<lock key>``
    The fenced store of one resource: hash of the highest applied fence and its value.
``<run>:applied:<lock key>``
    List of the writes the store applied, in the order it applied them.
``<run>:prerun``
    List of ``<task id> <time>``, one per ``task_prerun`` of a lock-window task:
    when a copy was picked up, before it took its lock.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

__all__ = [
    "TICK",
    "ExecutionRecorder",
    "FencedStore",
    "applied_key",
    "execution_key",
    "executions_key",
    "hold",
    "load_preruns",
    "prerun_key",
    "record_prerun",
    "watched_execution",
]

#: Seconds between two looks of a running execution at its lease.
TICK = 0.05
#: Longest a holder that saw its lease expire waits for the watchdog to call it lost.
VERDICT_WAIT = 2.0


def executions_key(run: str) -> str:
    """The list of execution ids of ``run``."""
    return f"{run}:executions"


def execution_key(run: str, execution_id: str) -> str:
    """The hash of one execution."""
    return f"{run}:execution:{execution_id}"


def applied_key(run: str, resource: str) -> str:
    """The log of writes the fenced store applied to ``resource``."""
    return f"{run}:applied:{resource}"


def prerun_key(run: str) -> str:
    """The list of ``task_prerun`` times of the lock-window tasks of ``run``."""
    return f"{run}:prerun"


# Apply a write only if its fence is not below the highest fence applied so far
# (equal: the same holder writing again).
#
# KEYS[1]  hash of the resource: fields "fence" and "value"
# KEYS[2]  list logging every applied write
# ARGV[1]  the writer's fence (a decimal integer)
# ARGV[2]  the value
# ARGV[3]  the writer's wall-clock time, logged with the write
# Returns  1 when applied, 0 when rejected as stale.
#
# Fences are compared as Lua numbers (doubles): exact below 2^53, and fences
# seeded from the server clock in microseconds stay far below that.
_STORE = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) >= stored then
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
  redis.call('RPUSH', KEYS[2], ARGV[1] .. ' ' .. ARGV[3] .. ' ' .. ARGV[2])
  return 1
end
return 0
"""


class FencedStore:
    """A downstream store that rejects a write whose fence is below one it already applied.

    This is what fencing tokens are for: a holder that lost its lock without
    knowing it still carries its old fence, and the store turns its late
    write away.

    Args:
        client: A client on the Redis holding the store.
        run: The scenario run's key prefix.
    """

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client = client
        self.run = run
        self._script = client.register_script(_STORE)

    def write(self, resource: str, fence: int, value: str) -> tuple[bool, float]:
        """Try the write; return whether it was applied and the time it was sent."""
        at = time.time()
        keys = [f"{self.run}:store:{resource}", applied_key(self.run, resource)]
        applied = self._script(keys=keys, args=[str(fence), value, repr(at)])
        return bool(applied), at

    def applied(self, resource: str) -> list[tuple[int, float, str]]:
        """The applied writes of ``resource``: (fence, time, value), in applied order."""
        entries = []
        for raw in self.client.lrange(applied_key(self.run, resource), 0, -1):
            fence, at, value = raw.decode().split(" ", 2)
            entries.append((int(fence), float(at), value))
        return entries


class ExecutionRecorder:
    """Writes the record of one execution holding ``lease`` (see the module docstring).

    Args:
        client: A client on the history Redis.
        run: The scenario run's key prefix.
        task_id: The task (or operation) id.
        lease: The lease held, a :class:`celery_redlock.Lease`.
    """

    def __init__(self, client: redis.Redis, run: str, task_id: str, lease: Any) -> None:
        self.client = client
        self.run = run
        self.task_id = task_id
        self.lease = lease
        self.id = f"{task_id}:{lease.fence}"
        self.key = execution_key(run, self.id)
        self.invalid_at: float | None = None
        self.writes: list[dict[str, Any]] = []

    def start(self) -> None:
        """Record the start; the pid lets a test pick this process to kill or stop."""
        now = time.time()
        fields = {
            "task_id": self.task_id,
            "key": self.lease.name,
            "fence": self.lease.fence,
            "pid": os.getpid(),
            "start": repr(now),
            "valid_until": repr(now + self.lease.remaining()),
        }
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.key, mapping=fields)
        pipe.rpush(executions_key(self.run), self.id)
        pipe.execute()

    def tick(self) -> bool:
        """Look at the lease once and record what is seen; return whether it is still valid.

        While the lease is valid the end of its validity is recorded on every
        tick, so a process killed without warning leaves the last end of
        validity it knew of.
        """
        now = time.time()
        remaining = self.lease.remaining()
        if remaining > 0 and not self.lease.lost:
            self.client.hset(self.key, "valid_until", repr(now + remaining))
            return True
        if self.invalid_at is None:
            self.invalid_at = now
            self.client.hset(self.key, "invalid_at", repr(now))
        return False

    def write(self, store: FencedStore, phase: str) -> bool:
        """Write to the fenced store under this lease's fence, and record the answer."""
        applied, at = store.write(self.lease.name, self.lease.fence, f"{self.id}/{phase}")
        self.writes.append({"phase": phase, "at": at, "applied": applied})
        return applied

    def finish(self) -> None:
        """Record the end and whether the holder learned that it lost the lease."""
        self.client.hset(
            self.key,
            mapping={
                "end": repr(time.time()),
                "lost": int(bool(self.lease.lost)),
                "writes": json.dumps(self.writes),
            },
        )


def hold(recorder: ExecutionRecorder, store: FencedStore, seconds: float) -> None:
    """Hold the lease for ``seconds`` the way a careless task would, then write again.

    Writes once right after the start and once at the end, whatever the lease
    says: the point is to show that the fenced store turns stale writes away.
    When the lease has expired (the process was frozen) the holder waits a
    moment for the watchdog's verdict, so ``lost`` says what the library told it.
    """
    recorder.write(store, "first")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        recorder.tick()
        time.sleep(TICK)
    if not recorder.tick() and not recorder.lease.lost:
        waited = time.monotonic() + VERDICT_WAIT
        while not recorder.lease.lost and time.monotonic() < waited:
            time.sleep(TICK)
    recorder.write(store, "last")


@contextmanager
def watched_execution(
    client: redis.Redis, run: str, task_id: str, lease: Any
) -> Iterator[ExecutionRecorder]:
    """Record one execution around the ``with`` body (start, then finish even on error)."""
    recorder = ExecutionRecorder(client, run, task_id, lease)
    recorder.start()
    try:
        yield recorder
    finally:
        recorder.finish()


def record_prerun(client: redis.Redis, run: str, task_id: str) -> None:
    """Record that a worker picked up ``task_id`` now (from ``task_prerun``)."""
    client.rpush(prerun_key(run), f"{task_id} {time.time()!r}")


def load_preruns(client: redis.Redis, run: str) -> list[tuple[str, float]]:
    """Every recorded ``task_prerun`` of ``run``: (task id, time), in record order."""
    entries = []
    for raw in client.lrange(prerun_key(run), 0, -1):
        task_id, at = raw.decode().split(" ")
        entries.append((task_id, float(at)))
    return entries
