"""The app of the chaos suite: singleton tasks that record every execution and fenced write.

Configured from the environment, like :mod:`tests.celery_apps.storm`:

``REDLOCK_TEST_BROKER``
    Broker URL (a private redis-server the suite may drop and restart).
``REDLOCK_TEST_BACKEND``
    Result backend URL; also where histories and the fenced store live.
``REDLOCK_TEST_LOCK_URL``
    Lock store: one URL (a private redis-server the suite restarts, freezes and
    flushes), a JSON list of URLs (Redlock over private masters), or Sentinel
    URLs (a private Sentinel group the suite fails over). The lock-window task
    is registered only on a single store, the one topology enqueue modes run on.
``REDLOCK_TEST_LOCK_OPTIONS``
    (optional) ``redlock_transport_options`` as JSON: ``master_name`` of a
    Sentinel lock store.
``REDLOCK_TEST_PREFIX``
    Key prefix of the locks and of the broker's and backend's keys.
``REDLOCK_TEST_QUEUE``
    ``task_default_queue``.

Each call names the scenario run it belongs to (``run``), so one set of
workers serves every scenario and each run's history stays apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from celery import Celery, Task
from celery import signals as celery_signals

from celery_redlock import SingletonTask, current_lock
from tests.celery_apps.storm import WakeUp
from tests.chaos.history import FencedStore, hold, record_prerun, watched_execution

__all__ = [
    "FAIR_TASKS",
    "LIMIT",
    "LIMITED_TASK",
    "LOCK_TTL",
    "WINDOW_TASK",
    "create_app",
    "environment",
    "lock_store_setting",
]

#: The task that runs in the until_and_while_executing window.
WINDOW_TASK = "chaos.window"

#: TTL of the chaos tasks' locks: short, so faults beyond it fit in a lean suite.
LOCK_TTL = 1.0
#: The task that runs with lock_limit=LIMIT (a semaphore; single lock store only).
LIMITED_TASK = "chaos.limited"
#: Permits per key of the limited task.
LIMIT = 2

_clients: dict[str, redis.Redis] = {}

# Both tasks take one lock per (run, resource) and wait for it: a duplicate is
# requeued, quickly, as often as needed, so every call ends up running.
_LOCK_OPTIONS: dict[str, Any] = {
    "base": SingletonTask,
    "bind": True,
    # shared=False: a shared task would be added to every app created later.
    "shared": False,
    "lock_ttl": LOCK_TTL,
    "lock_key": ["run", "resource"],
    "lock_on_conflict": "requeue",
    "lock_requeue_delay": 0.05,
    "lock_requeue_max_delay": 0.3,
    "lock_max_requeues": 100000,
}


def environment(
    *,
    broker: str,
    backend: str,
    lock_url: str | Sequence[str],
    prefix: str,
    queue: str,
    lock_options: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """The environment variables that configure the app (a list of URLs means Redlock)."""
    env = {
        "REDLOCK_TEST_BROKER": broker,
        "REDLOCK_TEST_BACKEND": backend,
        "REDLOCK_TEST_LOCK_URL": lock_url if isinstance(lock_url, str) else json.dumps(lock_url),
        "REDLOCK_TEST_PREFIX": prefix,
        "REDLOCK_TEST_QUEUE": queue,
    }
    if lock_options is not None:
        env["REDLOCK_TEST_LOCK_OPTIONS"] = json.dumps(dict(lock_options))
    return env


def lock_store_setting(value: str) -> str | list[str]:
    """``redlock_url`` from ``REDLOCK_TEST_LOCK_URL``: one URL, or a list from a JSON array."""
    if not value.startswith("["):
        return value
    urls = json.loads(value)
    if not isinstance(urls, list) or not all(isinstance(url, str) for url in urls):
        raise ValueError(f"REDLOCK_TEST_LOCK_URL is not a JSON list of URLs: {value!r}")
    return urls


def create_app(env: Mapping[str, str]) -> Celery:
    """Build the app and its tasks from ``env`` (see the module docstring)."""
    prefix = env["REDLOCK_TEST_PREFIX"]
    backend = env["REDLOCK_TEST_BACKEND"]
    app = Celery(f"chaos-{prefix}", set_as_current=False)
    keyprefix = {"global_keyprefix": f"{prefix}:"}
    lock_url = lock_store_setting(env["REDLOCK_TEST_LOCK_URL"])
    app.conf.update(
        broker_url=env["REDLOCK_TEST_BROKER"],
        result_backend=backend,
        redlock_url=lock_url,
        redlock_transport_options=json.loads(env.get("REDLOCK_TEST_LOCK_OPTIONS", "{}")),
        redlock_key_prefix=prefix,
        task_default_queue=env["REDLOCK_TEST_QUEUE"],
        control_exchange=f"{prefix}.ctl",
        broker_transport_options={
            # Unacknowledged messages of a dropped connection come back after
            # this long, not after kombu's default hour; longer than any task here.
            "visibility_timeout": 20,
            # A command on a frozen broker fails (and the worker reconnects)
            # instead of blocking the worker's event loop for good.
            "socket_timeout": 2,
            "socket_connect_timeout": 2,
        },
        result_backend_transport_options=keyprefix,
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=3600,
        worker_lost_wait=1.0,
    )
    _register_tasks(app)
    if isinstance(lock_url, str) and not lock_url.startswith("sentinel://"):
        _register_window_task(app)
        _register_limited_task(app)
        _register_fair_tasks(app)
    app.steps["consumer"].add(WakeUp)
    return app


def _history(task: Task) -> redis.Redis:
    url = task.app.conf.result_backend
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url)
    return client


class SlotLease:
    """A semaphore permit seen as a lock on its slot: ``<key>#<slot>``.

    One holder occupies a slot at a time, so the checker's per-key rules
    (exclusion, fence order, fenced writes) hold per slot, and the fenced
    store keys writes by slot, as docs/limits.md tells users to.
    """

    def __init__(self, lease: Any) -> None:
        self.lease = lease
        self.name = f"{lease.name}#{lease.slot}"
        self.fence = lease.fence

    @property
    def lost(self) -> bool:
        return bool(self.lease.lost)

    def remaining(self) -> float:
        return float(self.lease.remaining())


def _work(task: Task, run: str, seconds: float) -> str:
    lease = current_lock()
    if lease is None:
        raise RuntimeError(f"{task.name} runs without its lock")
    if getattr(lease, "slot", None) is not None:
        lease = SlotLease(lease)
    client = _history(task)
    with watched_execution(client, run, task.request.id, lease) as recorder:
        hold(recorder, FencedStore(client, run), seconds)
    return f"{task.request.id}:{lease.fence}"


def _register_tasks(app: Celery) -> None:
    @app.task(
        name="chaos.work",
        acks_late=True,
        reject_on_worker_lost=True,
        **_LOCK_OPTIONS,
    )
    def work(self: Task, run: str, resource: str, seconds: float) -> str:
        """Hold ``resource`` for ``seconds``, writing to the fenced store; acks late."""
        return _work(self, run, seconds)

    @app.task(name="chaos.work_early", acks_late=False, **_LOCK_OPTIONS)
    def work_early(self: Task, run: str, resource: str, seconds: float) -> str:
        """As ``work``, but acked when it starts: a killed run is gone for good."""
        return _work(self, run, seconds)


def _register_limited_task(app: Celery) -> None:
    @app.task(
        name=LIMITED_TASK,
        acks_late=True,
        reject_on_worker_lost=True,
        lock_limit=LIMIT,
        **_LOCK_OPTIONS,
    )
    def limited(self: Task, run: str, resource: str, seconds: float) -> str:
        """As ``work``, with up to LIMIT holders per key, each fenced by its slot."""
        return _work(self, run, seconds)


#: The fair-requeue soak's tasks: (lock_limit, lock_fair) by name.
FAIR_TASKS = {
    "chaos.fair1": (1, True),
    "chaos.fair3": (3, True),
    "chaos.unfair1": (1, False),
    "chaos.unfair3": (3, False),
}


def _register_fair_tasks(app: Celery) -> None:
    # Requeues that back off as a production task's would (scaled down): a
    # call that is unlucky without a line would wait ever longer.
    options = {
        **_LOCK_OPTIONS,
        "lock_key": ["run", "resource"],
        "lock_requeue_delay": 0.2,
        "lock_requeue_max_delay": 20.0,
    }
    for name, (limit, fair) in FAIR_TASKS.items():

        def fair_work(self: Task, run: str, resource: str, seconds: float) -> str:
            """Hold ``resource`` for ``seconds`` (one of ``limit`` holders), acks late."""
            return _work(self, run, seconds)

        app.task(
            name=name,
            acks_late=True,
            reject_on_worker_lost=True,
            lock_limit=limit,
            lock_fair=fair,
            **options,
        )(fair_work)


def _register_window_task(app: Celery) -> None:
    @app.task(
        name=WINDOW_TASK,
        acks_late=True,
        reject_on_worker_lost=True,
        lock_mode="until_and_while_executing",
        lock_on_duplicate="return_existing",
        **_LOCK_OPTIONS,
    )
    def window(self: Task, run: str, resource: str, seconds: float) -> str:
        """As ``work``, with at most one copy per key waiting and at most one running."""
        return _work(self, run, seconds)

    # task_prerun comes before the lock is taken, so before the copy's
    # reservation is handed over: the test orders it against the next publish.
    # (The sender is matched by name: before the app is finalized ``window``
    # is a proxy, not the task object the signal is sent with.)
    def prerun(sender: Any = None, task_id: Any = None, args: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == WINDOW_TASK and sender.app is app and args:
            record_prerun(_history(sender), str(args[0]), str(task_id))

    celery_signals.task_prerun.connect(prerun, weak=False)


def __getattr__(name: str) -> Any:
    # ``celery -A`` looks up ``app``; build it from the worker's environment then.
    if name == "app":
        app = create_app(os.environ)
        globals()["app"] = app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
