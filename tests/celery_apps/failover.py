"""The app of the failover test: one singleton task on a Sentinel lock store, duplicates skipped.

Configured from the environment, like :mod:`tests.celery_apps.chaos`:

``REDLOCK_TEST_BROKER``
    Broker and result backend URL (a private redis-server), also where
    executions are recorded.
``REDLOCK_TEST_LOCK_URL``
    The Sentinel URLs of the lock store (``master_name`` is
    :data:`tests.redis_topologies.MASTER_NAME`).
``REDLOCK_TEST_PREFIX``
    Key prefix of the locks and the execution records.
``REDLOCK_TEST_QUEUE``
    ``task_default_queue``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery, Task

from celery_redlock import SingletonTask, current_lock
from tests.celery_harness import record_execution
from tests.redis_topologies import MASTER_NAME

__all__ = ["TASK", "create_app", "environment"]

#: The task's name.
TASK = "failover.sync"

_clients: dict[str, redis.Redis] = {}


def environment(*, broker: str, lock_url: str, prefix: str, queue: str) -> dict[str, str]:
    """The environment variables that configure the app."""
    return {
        "REDLOCK_TEST_BROKER": broker,
        "REDLOCK_TEST_LOCK_URL": lock_url,
        "REDLOCK_TEST_PREFIX": prefix,
        "REDLOCK_TEST_QUEUE": queue,
    }


def create_app(env: Mapping[str, str]) -> Celery:
    """Build the app and its task from ``env`` (see the module docstring)."""
    prefix = env["REDLOCK_TEST_PREFIX"]
    app = Celery(f"failover-{prefix}", set_as_current=False)
    app.conf.update(
        broker_url=env["REDLOCK_TEST_BROKER"],
        result_backend=env["REDLOCK_TEST_BROKER"],
        redlock_url=env["REDLOCK_TEST_LOCK_URL"],
        redlock_transport_options={"master_name": MASTER_NAME},
        redlock_key_prefix=prefix,
        # Generous on a busy machine: WAIT returns at the acknowledgement.
        redlock_replica_timeout=1.0,
        # A refused acquisition (the store could not confirm it) comes back soon.
        redlock_requeue_delay=0.1,
        redlock_requeue_max_delay=0.3,
        redlock_max_requeues=10000,
        task_default_queue=env["REDLOCK_TEST_QUEUE"],
        control_exchange=f"{prefix}.ctl",
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
    )

    @app.task(name=TASK, base=SingletonTask, bind=True, shared=False, lock_ttl=5)
    def sync(self: Task, account: str, seconds: float) -> str:
        """Hold the lock of ``account`` for ``seconds``; record the execution."""
        lease = current_lock()
        url = self.app.conf.broker_url
        client = _clients.get(url) or _clients.setdefault(url, redis.Redis.from_url(url))
        with record_execution(
            client, prefix, task_id=self.request.id, name=TASK, lease=lease, hostname=None
        ):
            time.sleep(seconds)
        return f"{os.getpid()}:{lease.fence}"

    return app


def __getattr__(name: str) -> Any:
    # ``celery -A`` looks up ``app``; build it from the worker's environment then.
    if name == "app":
        app = create_app(os.environ)
        globals()["app"] = app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
