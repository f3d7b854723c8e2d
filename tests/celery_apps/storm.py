"""The app of the storm tests: singleton tasks that record every execution.

Configured entirely from the environment the harness gives each worker, so
one module serves every test without sharing state between them:

``REDLOCK_TEST_BROKER``
    Broker URL.
``REDLOCK_TEST_BACKEND``
    Result backend URL (Redis).
``REDLOCK_TEST_LOCK_URL``
    Lock store (``redlock_url``); default: the result backend.
``REDLOCK_TEST_PREFIX``
    The test's key prefix: ``redlock_key_prefix``, the history keys, and the
    broker's and backend's ``global_keyprefix`` on Redis.
``REDLOCK_TEST_QUEUE``
    ``task_default_queue``.
``REDLOCK_TEST_ACKS_LATE``
    ``"1"`` sets ``task_acks_late``.
``REDLOCK_TEST_QUEUES``
    JSON of ``redlock_queues``, when set.
``REDLOCK_TEST_BROKER_WRITE``
    ``broker_write_url``, when set: where the worker publishes (requeues) to.
``REDLOCK_TEST_TTL``
    ``redlock_ttl`` in seconds, when set (tasks without their own ``lock_ttl``).
``REDLOCK_TEST_INSTALL``
    ``"1"`` calls ``celery_redlock.install(app)`` (worker bootstep: stats, recovery).
``REDLOCK_TEST_SETTINGS``
    JSON object of further settings, applied last.

``celery -A tests.celery_apps.storm`` builds the app from ``os.environ`` on
first access of ``app``; tests build their own with :func:`create_app`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import redis
from celery import Celery, Task, bootsteps

from celery_redlock import SingletonTask, current_lock, install
from tests.celery_apps import limits, modes, rates, windows
from tests.celery_harness import HistoryRecorder, UnlockedLease, record_execution, wait_for_gate

__all__ = ["GATE_TIMEOUT", "create_app", "environment"]

#: Longest a task waits for its gate key before giving up (and saying so in its record).
GATE_TIMEOUT = 60.0
#: Interval of the lock checks of ``long_hold``.
CHECK_INTERVAL = 0.25

_clients: dict[str, redis.Redis] = {}


def environment(
    *,
    broker: str,
    backend: str,
    prefix: str,
    queue: str,
    acks_late: bool = False,
    lock_url: str | None = None,
) -> dict[str, str]:
    """The environment variables that configure the app, for the harness to pass on."""
    env = {
        "REDLOCK_TEST_BROKER": broker,
        "REDLOCK_TEST_BACKEND": backend,
        "REDLOCK_TEST_PREFIX": prefix,
        "REDLOCK_TEST_QUEUE": queue,
        "REDLOCK_TEST_ACKS_LATE": "1" if acks_late else "0",
    }
    if lock_url is not None:
        env["REDLOCK_TEST_LOCK_URL"] = lock_url
    return env


class _StormApp(Celery):  # type: ignore[misc]
    """The storm app, which a spawned pool process rebuilds with its tasks.

    Celery pickles an app as its configuration; the process that unpickles it
    gets no tasks, since ``_register_tasks`` binds them to one app
    (``shared=False``). Rebuild it from the environment the pool process
    inherits, then apply the configuration, which includes what the worker's
    main process changed at start.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_app, (dict(self._conf.changes),)


def _rebuild_app(changes: dict[str, Any]) -> Celery:
    app = create_app(os.environ)
    app.conf.update(changes)
    return app


def create_app(env: Mapping[str, str]) -> Celery:
    """Build the app and its tasks from ``env`` (see the module docstring)."""
    prefix = env["REDLOCK_TEST_PREFIX"]
    queue = env["REDLOCK_TEST_QUEUE"]
    broker = env["REDLOCK_TEST_BROKER"]
    backend = env["REDLOCK_TEST_BACKEND"]
    app = _StormApp(f"storm-{prefix}", set_as_current=False)
    keyprefix = {"global_keyprefix": f"{prefix}:"}
    app.conf.update(
        broker_url=broker,
        result_backend=backend,
        redlock_url=env.get("REDLOCK_TEST_LOCK_URL", backend),
        redlock_key_prefix=prefix,
        task_default_queue=queue,
        # Remote control of this test's workers only, whatever else shares the broker.
        control_exchange=f"{prefix}.ctl",
        broker_transport_options=keyprefix if broker.startswith("redis") else {},
        result_backend_transport_options=keyprefix,
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        task_acks_late=env.get("REDLOCK_TEST_ACKS_LATE") == "1",
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=3600,
        # A killed pool child is reported after this long (default 10 s).
        worker_lost_wait=1.0,
    )
    if env.get("REDLOCK_TEST_QUEUES"):
        app.conf.redlock_queues = json.loads(env["REDLOCK_TEST_QUEUES"])
    if env.get("REDLOCK_TEST_BROKER_WRITE"):
        app.conf.broker_write_url = env["REDLOCK_TEST_BROKER_WRITE"]
    if env.get("REDLOCK_TEST_TTL"):
        app.conf.redlock_ttl = float(env["REDLOCK_TEST_TTL"])
    if env.get("REDLOCK_TEST_SETTINGS"):
        app.conf.update(json.loads(env["REDLOCK_TEST_SETTINGS"]))
    if env.get("REDLOCK_TEST_INSTALL") == "1":
        install(app)
    _register_tasks(app)
    _register_lifecycle_tasks(app)
    _register_plain_tasks(app)
    modes.register(app)
    limits.register(app)
    rates.register(app)
    windows.register(app)
    app.steps["consumer"].add(WakeUp)
    return app


class WakeUp(bootsteps.StartStopStep):
    """Wakes the worker's event loop every 0.25 s.

    An idle worker's hub sleeps in ``epoll`` until its next timer, up to 10 s
    (on RabbitMQ nothing else wakes it). A warm shutdown only takes effect when
    the loop turns, so without this every test would wait that long to stop.
    """

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.entry: Any = None

    def start(self, parent: Any) -> None:
        if parent.hub is not None:
            self.entry = parent.timer.call_repeatedly(0.25, _nothing)

    def stop(self, parent: Any) -> None:
        if self.entry is not None:
            self.entry.cancel()
            self.entry = None


def _nothing() -> None:
    pass


def _client(url: str) -> redis.Redis:
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url)
    return client


def _history_client(task: Task) -> redis.Redis:
    return _client(task.app.conf.redlock_url)


@contextmanager
def _recording(task: Task) -> Iterator[HistoryRecorder]:
    lease = current_lock()
    if lease is None:
        raise RuntimeError(f"{task.name} runs without its lock")
    with record_execution(
        _history_client(task),
        task.app.conf.redlock_key_prefix,
        task_id=task.request.id,
        name=task.name,
        lease=lease,
        hostname=task.request.hostname,
    ) as recorder:
        yield recorder


def _sleep_then_wait(task: Task, recorder: HistoryRecorder, seconds: float, gate: str | None):
    time.sleep(seconds)
    if not wait_for_gate(_history_client(task), gate, GATE_TIMEOUT):
        recorder.extra["gate_timeout"] = True


def _register_tasks(app: Celery) -> None:
    # shared=False: a shared task would be added to every app created later in
    # the test process, with the first app's configuration.
    @app.task(base=SingletonTask, bind=True, shared=False, name="storm.hold")
    def hold(self: Task, x: Any, seconds: float, gate: str | None = None) -> Any:
        """Record the execution; sleep ``seconds``, then wait for key ``gate`` if given."""
        with _recording(self) as recorder:
            _sleep_then_wait(self, recorder, seconds, gate)
        return x

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="storm.hold_requeue",
        lock_on_conflict="requeue",
        lock_requeue_delay=0.05,
        lock_requeue_max_delay=0.5,
        lock_max_requeues=10000,
    )
    def hold_requeue(self: Task, x: Any, seconds: float, gate: str | None = None) -> Any:
        """As ``hold``, but a duplicate is requeued until the lock is free."""
        with _recording(self) as recorder:
            _sleep_then_wait(self, recorder, seconds, gate)
        return x

    @app.task(base=SingletonTask, bind=True, shared=False, name="storm.long_hold", lock_ttl=1)
    def long_hold(self: Task, seconds: float) -> dict[str, Any]:
        """Run ``seconds`` under a 1 s lock, checking every 0.25 s that the lock is still ours."""
        lease = current_lock()
        client = _history_client(self)
        with _recording(self) as recorder:
            lost_seen = False
            mismatches: list[str | None] = []
            pttls: list[int] = []
            checks = 0
            deadline = time.monotonic() + seconds
            while True:
                lost_seen = lost_seen or lease.lost
                value = client.get(lease.name)
                checks += 1
                if value != lease.token:
                    mismatches.append(value.decode() if value is not None else None)
                pttls.append(int(client.pttl(lease.name)))
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(CHECK_INTERVAL, left))
            report = {
                "lost": lost_seen or lease.lost,
                "checks": checks,
                "mismatches": mismatches,
                "pttls": pttls,
                "renewals": lease.renewals,
                "ttl": lease.ttl,
            }
            recorder.extra.update(report)
        return report


def started_key(prefix: str) -> str:
    """The Redis list of (task id, pid, fence, time) that lifecycle tasks push when they start."""
    return f"{prefix}:started"


def _announce_start(task: Task) -> None:
    # Pushed at the start, unlike the history record written at the end, so a
    # test can find (and kill) the process running a task that never ends.
    lease = current_lock()
    record = {"task_id": task.request.id, "pid": os.getpid(), "time": time.time()}
    record["fence"] = lease.fence if lease is not None else None
    _history_client(task).rpush(started_key(task.app.conf.redlock_key_prefix), json.dumps(record))


def _register_plain_tasks(app: Celery) -> None:
    """Plain tasks, locked only when consumed from a locked queue (test_queues)."""

    @app.task(bind=True, shared=False, name="storm.plain")
    def plain(self: Task, x: Any, seconds: float, gate: str | None = None) -> Any:
        """Record the execution (lock or not); sleep, then wait for ``gate`` if given."""
        lease = current_lock() or UnlockedLease(f"unlocked:{x}")
        with record_execution(
            _history_client(self),
            self.app.conf.redlock_key_prefix,
            task_id=self.request.id,
            name=self.name,
            lease=lease,
            hostname=self.request.hostname,
        ) as recorder:
            recorder.extra["locked"] = current_lock() is not None
            _sleep_then_wait(self, recorder, seconds, gate)
        return x


def _register_lifecycle_tasks(app: Celery) -> None:
    """Tasks that die, time out or are revoked mid-run (tests/integration/celery/test_lifecycle)."""

    def wait_for_gate(task: Task, gate: str) -> None:
        _announce_start(task)
        with _recording(task) as recorder:
            _sleep_then_wait(task, recorder, 0, gate)

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="storm.mortal",
        # Longer than worker_lost_wait: the redelivered copy meets the dead copy's lock.
        lock_ttl=10,
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def mortal(self: Task, x: Any, gate: str) -> Any:
        """Wait for ``gate``; acks late, and a lost worker puts the message back."""
        wait_for_gate(self, gate)
        return x

    @app.task(base=SingletonTask, bind=True, shared=False, name="storm.mortal_early", lock_ttl=2)
    def mortal_early(self: Task, x: Any, gate: str) -> Any:
        """Wait for ``gate``; acked when it starts, so a killed run is gone for good."""
        wait_for_gate(self, gate)
        return x

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="storm.soft_limited",
        lock_ttl=30,
        soft_time_limit=0.5,
    )
    def soft_limited(self: Task, seconds: float) -> None:
        """Sleep past a 0.5 s soft time limit, under a TTL too long to explain a release."""
        _announce_start(self)
        time.sleep(seconds)

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="storm.hard_limited",
        lock_ttl=2,
        time_limit=1,
    )
    def hard_limited(self: Task, seconds: float) -> None:
        """Sleep past a 1 s hard time limit: the child is killed mid-run."""
        _announce_start(self)
        time.sleep(seconds)


def __getattr__(name: str) -> Any:
    # ``celery -A`` looks up ``app``; build it from the worker's environment then,
    # never at import, so tests can import this module for create_app().
    if name == "app":
        app = create_app(os.environ)
        globals()["app"] = app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
