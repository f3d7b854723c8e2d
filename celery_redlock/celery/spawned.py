"""Per-queue locking in prefork pool processes started with ``spawn`` instead of ``fork``.

A forked pool process inherits what :class:`~celery_redlock.celery.bootsteps.RedlockStep`
set up in the worker's main process: the wrapped plain tasks and the queue
locks. A spawned one (``worker_pool_start_method = "spawn"``,
``--pool-start-method=spawn``, or billiard's default on platforms where it is
not ``fork``) is a fresh interpreter: it rebuilds the app from its pickled
configuration, imports the task modules again and inherits none of it, so
plain tasks from locked queues would run without a lock.

The main process therefore hands the set-up over before the pool starts
(:func:`hand_over`):

- what only the main process knows goes into the environment variable
  :data:`ENV_VAR`, which every spawned process inherits: the queues this
  worker consumes (``-Q`` is applied in the main process only) and the
  ``--redlock-queues`` value; the settings themselves are read again from the
  app's configuration, which travels with the app;
- :mod:`celery_redlock.celery.spawn_hook` is added to the app's ``imports``
  setting. A spawned process imports it while it loads the task modules,
  before ``worker_process_init``, and importing it connects
  :func:`set_up_pool_process` to that signal. That is the one way code of ours
  reaches a process the worker did not fork when the app module never calls
  :func:`~celery_redlock.celery.install` (the command-line worker installs
  celery-redlock by itself).

The pool process then runs the main process's own set-up again
(:func:`~celery_redlock.celery.queues.lock_queues`) and rebuilds the tracers,
which Celery built before ``worker_process_init`` around the unwrapped task
bodies. A forked worker never gets here: the main process does not touch the
environment or ``imports``, and its pool processes pay nothing.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery import signals

from .queues import lock_queues, registered

__all__ = [
    "ENV_VAR",
    "HOOK_MODULE",
    "connect",
    "hand_over",
    "set_up_pool_process",
    "spawns_pool_processes",
]

logger = logging.getLogger(__name__)

#: The environment variable that carries the main process's per-queue set-up to spawned
#: pool processes (JSON: app name, ``--redlock-queues`` value, consumed queues' routes).
ENV_VAR = "CELERY_REDLOCK_POOL_SETUP"
#: The module spawned pool processes import (through ``imports``) to connect the handler.
HOOK_MODULE = "celery_redlock.celery.spawn_hook"


@dataclass(frozen=True)
class _Exchange:
    name: str
    type: str


@dataclass(frozen=True)
class _ConsumedQueue:
    """What :class:`~celery_redlock.celery.queues.QueueLocks` reads of a consumed queue."""

    name: str
    exchange: _Exchange | None
    routing_key: str | None


def spawns_pool_processes(worker: Any) -> bool:
    """Whether ``worker``'s pool starts its processes in fresh interpreters.

    Only the prefork pool has processes of its own. Celery 5.7 spawns them
    when ``worker_pool_start_method`` (``--pool-start-method``) is ``spawn``;
    otherwise billiard's default start method decides (``spawn`` on some
    platforms).
    """
    from celery.concurrency.prefork import TaskPool

    pool_cls = getattr(worker, "pool_cls", None)
    if not (isinstance(pool_cls, type) and issubclass(pool_cls, TaskPool)):
        return False
    if getattr(worker, "pool_start_method", None) == "spawn":
        return True
    import billiard

    return bool(billiard.get_start_method() != "fork")


def hand_over(app: Any, cli_queues: str | None, consumed: Mapping[str, Any]) -> None:
    """In the main process, before the pool starts: let spawned pool processes lock too.

    Args:
        app: The worker's app.
        cli_queues: The ``--redlock-queues`` value, if given.
        consumed: The queues this worker consumes, by name.
    """
    routes = []
    for name, queue in consumed.items():
        exchange = queue.exchange
        routes.append(
            [
                name,
                None if exchange is None else exchange.name,
                None if exchange is None else exchange.type,
                queue.routing_key,
            ]
        )
    os.environ[ENV_VAR] = json.dumps({"app": app.main, "cli": cli_queues, "queues": routes})
    imports = tuple(app.conf.imports or ())
    if HOOK_MODULE not in imports:
        app.conf.imports = (*imports, HOOK_MODULE)


def set_up_pool_process(sender: Any = None, **kwargs: Any) -> None:
    """``worker_process_init`` handler: turn on per-queue locking in a spawned pool process.

    ``sender`` is the worker's node name. Does nothing in a process that
    already has the queue locks (forked) or was not handed any.

    Raises:
        SystemExit: If the set-up fails. Celery only logs exceptions raised by
            signal handlers, and the process would then run the tasks of
            locked queues without a lock; exiting makes the failure loud.
    """
    payload = os.environ.get(ENV_VAR)
    if not payload:
        return
    from celery._state import get_current_app

    app = get_current_app()
    setup = json.loads(payload)
    if setup.get("app") != app.main or registered(app) is not None:
        return
    from celery.app.trace import build_tracer

    try:
        consumed = {
            name: _ConsumedQueue(
                name, None if exchange is None else _Exchange(exchange, kind), routing_key
            )
            for name, exchange, kind, routing_key in setup["queues"]
        }
        lock_queues(app, setup.get("cli"), consumed)
        # Celery built the tracers before worker_process_init, around the
        # unwrapped bodies (build_tracer captures task.run): build them again.
        for name, task in app.tasks.items():
            task.__trace__ = build_tracer(name, task, app.loader, sender, app=app)
    except Exception as exc:
        logger.critical(
            "celery-redlock: could not set up per-queue locking in spawned pool process %d; "
            "exiting rather than running tasks of locked queues without a lock",
            os.getpid(),
            exc_info=True,
        )
        raise SystemExit(f"celery-redlock: pool process set-up failed: {exc!r}") from exc
    logger.debug("celery-redlock: per-queue locking set up in pool process %d", os.getpid())


def connect() -> None:
    """Connect :func:`set_up_pool_process` to ``worker_process_init`` (once per process)."""
    signals.worker_process_init.connect(
        set_up_pool_process, weak=False, dispatch_uid="celery-redlock-spawned-pool-process"
    )
