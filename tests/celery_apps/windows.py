"""Tasks of the newest-call and period windows (tests/integration/celery/test_windows.py).

Every task takes ``(k, x, seconds=0)``: ``k`` is the lock key, ``x`` the
argument whose value shows which call ran. Each run pushes a ``start`` record
when its body begins and an ``end`` record when it returns, to
:func:`runs_key`, so tests can see which arguments ran, when, and whether two
runs overlapped.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis
from celery import Celery, Task

from celery_redlock import SingletonTask

__all__ = ["KILL_FLAG", "register", "runs", "runs_key"]

#: While this key (under the prefix) exists, the first delivery of ``windows.mortal``
#: SIGKILLs its own pool process as it starts.
KILL_FLAG = "windows:kill"

_clients: dict[str, redis.Redis] = {}


def runs_key(prefix: str) -> str:
    """The list of run records of this test's window tasks."""
    return f"{prefix}:windows:runs"


def runs(client: redis.Redis, prefix: str, phase: str = "start") -> list[dict[str, Any]]:
    """Every ``start`` (or ``end``) record so far, oldest first."""
    records = [json.loads(raw) for raw in client.lrange(runs_key(prefix), 0, -1)]
    return [r for r in records if r["phase"] == phase]


def _client(task: Task) -> redis.Redis:
    url = task.app.conf.result_backend
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url)
    return client


def _record(task: Task, phase: str, k: Any, x: Any) -> None:
    record = {
        "phase": phase,
        "task_id": task.request.id,
        "k": k,
        "x": x,
        "time": time.time(),
        "pid": os.getpid(),
    }
    prefix = task.app.conf.redlock_key_prefix
    _client(task).rpush(runs_key(prefix), json.dumps(record))


def _run(task: Task, k: Any, x: Any, seconds: float) -> Any:
    _record(task, "start", k, x)
    time.sleep(seconds)
    _record(task, "end", k, x)
    return x


def register(app: Celery) -> None:
    """Register the window tasks on ``app``."""
    common = {"base": SingletonTask, "bind": True, "shared": False, "lock_key": ["k"]}

    @app.task(name="windows.debounce", lock_mode="debounce", lock_debounce=1, **common)
    def debounce(self: Task, k: Any, x: Any, seconds: float = 0) -> Any:
        """Debounced by one second."""
        return _run(self, k, x, seconds)

    @app.task(
        name="windows.debounce_max",
        lock_mode="debounce",
        lock_debounce=1,
        lock_debounce_max_wait=1.5,
        **common,
    )
    def debounce_max(self: Task, k: Any, x: Any, seconds: float = 0) -> Any:
        """Debounced by one second, a burst waiting at most 1.5 s."""
        return _run(self, k, x, seconds)

    @app.task(
        name="windows.latest",
        lock_mode="until_and_while_executing",
        lock_keep="latest",
        lock_requeue_delay=0.05,
        lock_requeue_max_delay=0.2,
        lock_max_requeues=10000,
        **common,
    )
    def latest(self: Task, k: Any, x: Any, seconds: float = 0) -> Any:
        """One runs, the newest call waits."""
        return _run(self, k, x, seconds)

    @app.task(name="windows.expired", lock_mode="until_expired", lock_period=2, **common)
    def expired(self: Task, k: Any, x: Any, seconds: float = 0) -> Any:
        """Accepted at most once every two seconds."""
        return _run(self, k, x, seconds)

    @app.task(
        name="windows.mortal",
        lock_mode="debounce",
        lock_debounce=1,
        # Longer than worker_lost_wait: the redelivered copy meets the dead copy's lock.
        lock_ttl=2,
        acks_late=True,
        reject_on_worker_lost=True,
        **common,
    )
    def mortal(self: Task, k: Any, x: Any, seconds: float = 0) -> Any:
        """Debounced; its first delivery dies by SIGKILL while :data:`KILL_FLAG` exists."""
        _record(self, "start", k, x)
        flag = f"{self.app.conf.redlock_key_prefix}:{KILL_FLAG}"
        if _client(self).delete(flag):
            os.kill(os.getpid(), signal.SIGKILL)
        _record(self, "end", k, x)
        return x
