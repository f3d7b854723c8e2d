"""``install(app)``: connect celery-redlock to an app's workers.

Nothing is connected at import time. ``install`` adds the worker bootstep (and
with it the ``--redlock-queues`` worker option) and the signal hooks; it runs
by itself when a command-line worker is started with ``--redlock-queues`` or
with ``redlock_queues`` configured. Installing twice is harmless.
"""

from __future__ import annotations

import weakref
from typing import Any

import click

__all__ = ["WORKER_OPTION_NAME", "install", "worker_option"]

#: The keyword the worker option reaches bootsteps as.
WORKER_OPTION_NAME = "redlock_queues"

_installed: weakref.WeakSet[Any] = weakref.WeakSet()


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


def install(app: Any) -> None:
    """Connect celery-redlock to the workers of ``app``.

    Adds the worker bootstep that validates the redlock settings at worker
    start, checks the lock store and turns on per-queue locking; the
    ``--redlock-queues`` worker option (unless the ``celery redlock`` plugin
    already added it); and the signal handler that releases the lock of a
    task killed by ``revoke(terminate=True, signal="SIGKILL")``. Call it from
    the module that creates the app; calling it again does nothing.
    """
    if app in _installed:
        return
    _installed.add(app)
    from celery.bin.worker import worker as worker_command

    from . import hooks
    from .bootsteps import RedlockStep

    if not any(param.name == WORKER_OPTION_NAME for param in worker_command.params):
        app.user_options["worker"].add(worker_option())
    app.steps["worker"].add(RedlockStep)
    hooks.connect()
