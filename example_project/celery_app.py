"""The Celery app of the invoice-sync service.

Broker, result backend and lock store are one Redis, named by ``DEMO_REDIS_URL``
(default ``redis://127.0.0.1:6379/12``: a database of its own). Every key the
app writes starts with ``DEMO_KEY_PREFIX`` (default ``invoice-demo``), so a
demo run can delete exactly its own keys and nothing else. The driver gives
each run its own prefix, so two runs on one server never see each other.

Two queues lock every task consumed from them, without the tasks' code knowing:
``EXPORTS_QUEUE`` through the ``redlock_queues`` setting below, and
``REMINDERS_QUEUE`` through the worker option ``--redlock-queues`` (see
:data:`WORKER_ARGS`). Start a worker the way the demo does::

    celery -A example_project.celery_app worker \
        -Q invoice-demo,invoice-demo-exports,invoice-demo-reminders \
        --redlock-queues=invoice-demo-reminders
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready

REDIS_URL = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379/12")
PREFIX = os.environ.get("DEMO_KEY_PREFIX", "invoice-demo")
QUEUE = "invoice-demo"
#: Statement exports: plain tasks, locked because this app configures the queue.
EXPORTS_QUEUE = "invoice-demo-exports"
#: Payment reminders: plain tasks, locked because the worker is told to.
REMINDERS_QUEUE = "invoice-demo-reminders"
#: The worker arguments that select the queues and lock the reminders queue.
WORKER_ARGS = (
    "-Q",
    f"{QUEUE},{EXPORTS_QUEUE},{REMINDERS_QUEUE}",
    f"--redlock-queues={REMINDERS_QUEUE}",
)

app = Celery("invoice_demo", include=["example_project.tasks"])
app.conf.update(
    broker_url=REDIS_URL,
    result_backend=REDIS_URL,
    # redlock_url is not set: the lock store defaults to the broker's Redis.
    redlock_key_prefix=f"{PREFIX}:lock",
    # Per-queue locking by configuration: every task consumed from the exports
    # queue runs under a lock keyed by its name and arguments; a duplicate waits
    # its turn. The reminders queue is locked by the worker's --redlock-queues
    # instead, with the app-wide defaults (a duplicate is skipped).
    redlock_queues={
        EXPORTS_QUEUE: {
            "on_conflict": "requeue",
            "requeue_delay": 0.1,
            "requeue_max_delay": 0.4,
            "max_requeues": 50,
        },
    },
    task_routes={
        "example_project.tasks.export_statement": {"queue": EXPORTS_QUEUE},
        "example_project.tasks.send_reminder": {"queue": REMINDERS_QUEUE},
    },
    # Queues, bindings and results go under the prefix too.
    broker_transport_options={"global_keyprefix": f"{PREFIX}:"},
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:"},
    task_default_queue=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # One message per pool process at a time: duplicates queue up in Redis,
    # where any free process can take them, not behind a busy one.
    worker_prefetch_multiplier=1,
    # The demo reads task states from Redis; it needs no remote control, which
    # would add broadcast channels shared by every app on the server.
    worker_enable_remote_control=False,
    broker_connection_retry_on_startup=True,
    result_expires=3600,
)

_clients: dict[str, redis.Redis] = {}


def demo_redis() -> redis.Redis:
    """Return this process's client of the demo's Redis (created on first use, after fork)."""
    client = _clients.get(REDIS_URL)
    if client is None:
        client = _clients[REDIS_URL] = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    return client


def ready_key() -> str:
    """The key a worker sets, to its pid, once it consumes (the driver waits for it)."""
    return f"{PREFIX}:worker-ready"


@worker_ready.connect
def _announce_ready(**_: Any) -> None:
    demo_redis().set(ready_key(), os.getpid(), ex=600)
