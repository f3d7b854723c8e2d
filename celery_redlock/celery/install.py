"""``install(app)``: connect celery-redlock to an app's workers.

Nothing is connected at import time. :func:`connect_worker` adds the worker
bootsteps and the signal hooks; ``SingletonTask`` calls it when it is bound to
an app. ``install`` does the same and adds the ``--redlock-queues`` worker
option; it runs by itself when a command-line worker is started with
``--redlock-queues`` or with ``redlock_queues`` configured. Both are idempotent.
"""

from __future__ import annotations

import weakref
from typing import Any

import click

__all__ = [
    "METRICS_OPTION_NAME",
    "RECOVER_OPTION_NAME",
    "WORKER_OPTION_NAME",
    "connect_worker",
    "install",
    "metrics_option",
    "recover_option",
    "worker_option",
    "worker_options",
]

#: The keyword the worker option reaches bootsteps as.
WORKER_OPTION_NAME = "redlock_queues"
#: The keyword ``--redlock-recover/--no-redlock-recover`` reaches bootsteps as:
#: the name of the setting it overrides.
RECOVER_OPTION_NAME = "redlock_recover_stale"
#: The keyword ``--redlock-metrics-port`` reaches bootsteps as: the setting it overrides.
METRICS_OPTION_NAME = "redlock_metrics_port"

# Apps already connected, and apps whose worker options were already added.
_connected: weakref.WeakSet[Any] = weakref.WeakSet()
_options_added: weakref.WeakSet[Any] = weakref.WeakSet()


def worker_option() -> click.Option:
    """Return the ``--redlock-queues`` option of ``celery worker``."""
    from celery.bin.base import CeleryOption

    option: click.Option = CeleryOption(
        ["--redlock-queues"],
        default=None,
        help_group="Locking Options",
        help=(
            "celery-redlock: comma-separated queues whose tasks this worker runs under a "
            "lock keyed by task name and arguments (merged with the redlock_queues setting)."
        ),
    )
    return option


def recover_option() -> click.Option:
    """Return the ``--redlock-recover/--no-redlock-recover`` option of ``celery worker``."""
    from celery.bin.base import CeleryOption

    option: click.Option = CeleryOption(
        ["--redlock-recover/--no-redlock-recover", RECOVER_OPTION_NAME],
        default=None,
        help_group="Locking Options",
        help=(
            "celery-redlock: at start, release the locks left by a dead earlier run of this "
            "worker (same node name and host); overrides the redlock_recover_stale setting."
        ),
    )
    return option


def metrics_option() -> click.Option:
    """Return the ``--redlock-metrics-port`` option of ``celery worker``."""
    from celery.bin.base import CeleryOption

    option: click.Option = CeleryOption(
        ["--redlock-metrics-port", METRICS_OPTION_NAME],
        type=int,
        default=None,
        help_group="Locking Options",
        help=(
            "celery-redlock: serve this worker's lock metrics in Prometheus format on this "
            "port (bound to redlock_metrics_host, default 127.0.0.1); overrides the "
            "redlock_metrics_port setting."
        ),
    )
    return option


def worker_options() -> list[click.Option]:
    """Return the options celery-redlock adds to ``celery worker``."""
    return [worker_option(), recover_option(), metrics_option()]


def install(app: Any) -> None:
    """Connect celery-redlock to the workers of ``app``.

    A ``SingletonTask`` bound to the app connects it by itself
    (:func:`connect_worker`); call this from the module that creates the app
    when only queues are locked (``redlock_queues``, ``--redlock-queues``).
    Besides what :func:`connect_worker` does, it adds the ``--redlock-queues``,
    ``--redlock-recover`` and ``--redlock-metrics-port`` worker options (unless
    the ``celery redlock`` plugin already added them). Calling it again does nothing.
    """
    if app in _options_added:
        return
    _options_added.add(app)
    from celery.bin.worker import worker as worker_command

    connect_worker(app)
    known = {param.name for param in worker_command.params}
    for option in worker_options():
        if option.name not in known:
            app.user_options["worker"].add(option)


def connect_worker(app: Any) -> None:
    """Add celery-redlock's bootsteps and signal hooks to the workers of ``app`` (idempotent).

    The worker bootstep validates the redlock settings at worker start, checks
    the lock store, turns on per-queue locking and the lock counters, and
    releases the stale locks of a dead earlier run of the worker; the ops
    bootstep runs the reaper, the counters' history and the metrics endpoint
    (:mod:`celery_redlock.celery.worker_ops`); the consumer
    bootstep checks each queue the worker is told to consume at runtime
    (``add_consumer``); the signal handler releases the lock of a task killed
    by ``revoke(terminate=True, signal="SIGKILL")``. ``SingletonTask`` calls it
    when it is bound to the app: a worker finalizes its app before it builds
    its bootsteps, so they are in place whatever the app's module does.
    """
    if app in _connected:
        return
    _connected.add(app)
    from . import hooks
    from .added_queues import AddedQueuesStep
    from .bootsteps import RedlockStep
    from .worker_ops import OpsStep

    app.steps["worker"].add(RedlockStep)
    app.steps["worker"].add(OpsStep)
    app.steps["consumer"].add(AddedQueuesStep)
    hooks.connect()
