"""Tasks of the lock-mode tests (tests/integration/celery/test_modes.py).

Registered on the storm app by :func:`register`. Every task pushes a start
record (task id, attempt, time, pid, fence) to :func:`started_key` when its
body begins, so tests can see queued, running and retried copies; tasks that
hold an execution lock also write the usual history record. Workers record
``lock_lapsed`` signals and the ``task_prerun`` times of ``modes.storm`` so
tests can check what the worker saw, in the order Redis saw it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery import Celery, Task
from celery import signals as celery_signals
from celery.exceptions import Reject

from celery_redlock import SingletonTask, current_lock
from celery_redlock.celery import signals
from tests.celery_harness import UnlockedLease, record_execution, wait_for_gate

__all__ = [
    "DUPLICATE_POLICIES",
    "MODES",
    "RETRY_FIRST",
    "lapsed_key",
    "prerun_key",
    "register",
    "started",
    "started_key",
    "task_name",
]

DUPLICATE_POLICIES = ("return_existing", "raise")
#: The windows that keep the first call (the others are in tests.celery_apps.windows).
MODES = ("while_executing", "until_executing", "until_executed", "until_and_while_executing")
GATE_TIMEOUT = 30.0
#: Retry countdown of each ``modes.retry_first.<mode>`` task, in seconds.
RETRY_FIRST = {"until_executing": 0.5, "until_and_while_executing": 2.5}

_clients: dict[str, redis.Redis] = {}


def task_name(mode: str, on_duplicate: str = "return_existing") -> str:
    """The name of the gated task registered for ``mode`` and ``on_duplicate``."""
    return f"modes.{mode}.{on_duplicate}"


def started_key(prefix: str) -> str:
    """The list of start records of this test's mode tasks."""
    return f"{prefix}:modes:started"


def lapsed_key(prefix: str) -> str:
    """The list of ``lock_lapsed`` signals the workers saw (task id, key, mode)."""
    return f"{prefix}:modes:lapsed"


def prerun_key(prefix: str) -> str:
    """The list of (task id, time) of every ``task_prerun`` of ``modes.storm``."""
    return f"{prefix}:modes:prerun"


def started(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every start record so far, oldest first."""
    return [json.loads(raw) for raw in client.lrange(started_key(prefix), 0, -1)]


def _client(task: Task) -> redis.Redis:
    url = task.app.conf.redlock_url
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url)
    return client


def _announce(task: Task, **extra: Any) -> None:
    lease = current_lock()
    record = {
        "task_id": task.request.id,
        "name": task.name,
        "retries": task.request.retries,
        "time": time.time(),
        "pid": os.getpid(),
        "fence": lease.fence if lease is not None else None,
        "key": lease.name if lease is not None else None,
        **extra,
    }
    prefix = task.app.conf.redlock_key_prefix
    _client(task).rpush(started_key(prefix), json.dumps(record))


@contextmanager
def _recorded(task: Task, x: Any) -> Iterator[Any]:
    """Record this run of ``task`` (call ``x``) in the history, with its lock if it holds one."""
    lease = current_lock() or UnlockedLease(f"unlocked:{task.name}:{x}")
    with record_execution(
        _client(task),
        task.app.conf.redlock_key_prefix,
        task_id=task.request.id,
        name=task.name,
        lease=lease,
        hostname=task.request.hostname,
    ) as recorder:
        yield recorder


def _run_recorded(task: Task, x: Any, gate: str | None, seconds: float = 0.0) -> Any:
    _announce(task)
    with _recorded(task, x) as recorder:
        time.sleep(seconds)
        recorder.extra["gate_timeout"] = not wait_for_gate(_client(task), gate, GATE_TIMEOUT)
    return x


def register(app: Celery) -> None:
    """Register the mode tasks on ``app`` and connect the workers' recorders."""
    for mode in MODES:
        for on_duplicate in DUPLICATE_POLICIES:
            _register_gated(app, mode, on_duplicate)
    for mode, countdown in RETRY_FIRST.items():
        _register_retry_first(app, mode, countdown)

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="modes.retry",
        lock_mode="until_executed",
        max_retries=2,
    )
    def retry(self: Task, x: Any) -> Any:
        """Fail twice with self.retry(), then fail for good."""
        _announce(self)
        if self.request.retries < 2:
            raise self.retry(countdown=0.3)
        raise ValueError(f"attempt {self.request.retries} failed for good")

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="modes.autoretry",
        lock_mode="until_executed",
        autoretry_for=(ValueError,),
        retry_kwargs={"max_retries": 1, "countdown": 0.3},
    )
    def autoretry(self: Task, x: Any) -> Any:
        """Always raise ValueError: autoretry once, then fail."""
        _announce(self)
        raise ValueError(f"attempt {self.request.retries}")

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="modes.unpublishable_retry",
        lock_mode="until_executed",
        lock_key=["x"],
    )
    def unpublishable_retry(self: Task, x: Any, extra: Any = None) -> Any:
        """Retry with an argument JSON cannot encode: the retry's publish fails."""
        _announce(self)
        raise self.retry(kwargs={"x": x, "extra": object()}, countdown=0.1)

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="modes.eta",
        lock_mode="until_executed",
        lock_enqueue_ttl=1,
    )
    def eta(self: Task, x: Any) -> Any:
        """Record the start; the 1 s enqueue TTL alone would lapse long before a 5 s eta."""
        _announce(self)
        return x

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="modes.short_reservation",
        lock_mode="until_executed",
        lock_enqueue_ttl=0.3,
    )
    def short_reservation(self: Task, x: Any) -> Any:
        """Record the start; its 0.3 s enqueue lock lapses while no worker runs."""
        _announce(self)
        return x

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="modes.storm",
        lock_mode="until_and_while_executing",
        lock_on_conflict="requeue",
        lock_requeue_delay=0.05,
        lock_requeue_max_delay=0.2,
        lock_max_requeues=10000,
    )
    def storm(self: Task, x: Any, seconds: float) -> Any:
        """Run ``seconds``; a copy that meets the running one is requeued."""
        return _run_recorded(self, x, None, seconds)

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="modes.reject",
        lock_mode="until_executed",
    )
    def reject(self: Task, x: Any) -> Any:
        """Reject the message for good (FAILURE, written by the worker's main process)."""
        _announce(self)
        raise Reject(f"rejecting {x}", requeue=False)

    @app.task(bind=True, shared=False, name="modes.after")
    def after(self: Task, *args: Any) -> Any:
        """A plain chain step that records its start."""
        _announce(self, args=list(args))
        return "after"

    _connect_recorders()


def _register_gated(app: Celery, mode: str, on_duplicate: str) -> None:
    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name=task_name(mode, on_duplicate),
        lock_mode=mode,
        lock_on_duplicate=on_duplicate,
    )
    def gated(self: Task, x: Any, gate: str | None = None) -> Any:
        """Record the start, then wait for key ``gate``."""
        return _run_recorded(self, x, gate)


def _register_retry_first(app: Celery, mode: str, countdown: float) -> None:
    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name=f"modes.retry_first.{mode}",
        lock_mode=mode,
        lock_on_conflict="skip",
        lock_requeue_delay=0.1,
        lock_requeue_max_delay=0.2,
        max_retries=1,
    )
    def retry_first(self: Task, x: Any, gate: str) -> Any:
        """The first copy to start retries when ``<gate>:retry`` is set; others wait on ``gate``."""
        _announce(self)
        client = _client(self)
        retrier = f"{gate}:retrier"
        first = self.request.retries == 0 and client.set(retrier, self.request.id, nx=True)
        with _recorded(self, x) as recorder:
            opened = wait_for_gate(client, f"{gate}:retry" if first else gate, GATE_TIMEOUT)
            recorder.extra["gate_timeout"] = not opened
        if first:
            raise self.retry(countdown=countdown)
        return x


def _connect_recorders() -> None:
    signals.lock_lapsed.connect(_record_lapsed, weak=False, dispatch_uid="modes-lapsed")
    celery_signals.task_prerun.connect(_record_prerun, weak=False, dispatch_uid="modes-prerun")


def _record_lapsed(sender: Any = None, task_id: Any = None, **kwargs: Any) -> None:
    record = {"task_id": task_id, "key": kwargs.get("key"), "mode": kwargs.get("mode")}
    _client(sender).rpush(lapsed_key(sender.app.conf.redlock_key_prefix), json.dumps(record))


def _record_prerun(sender: Any = None, task_id: Any = None, **kwargs: Any) -> None:
    if getattr(sender, "name", None) != "modes.storm":
        return
    record = {"task_id": task_id, "time": time.time()}
    _client(sender).rpush(prerun_key(sender.app.conf.redlock_key_prefix), json.dumps(record))
