"""The ``celery redlock`` commands, and the worker options of celery-redlock.

Celery loads this module through the ``celery.commands`` entry point whenever
the ``celery`` program starts, before it loads the app. It then adds the
worker options (``--redlock-queues``, ``--redlock-recover``,
``--redlock-metrics-port``) to ``celery worker`` and installs celery-redlock in
any worker started with one of them or with ``redlock_queues`` configured. The
operator commands (``list``, ``show``, ``release``, ``purge``, ``stats``) live
in :mod:`celery_redlock.ops_cli`, the dashboard (``web``) in
:mod:`celery_redlock.ops.web`.
"""

from __future__ import annotations

import sys
from typing import Any

import click
from celery import signals
from celery.bin.base import CeleryCommand
from celery.bin.worker import worker as worker_command

from . import control  # noqa: F401  # registers redlock_stats for `celery inspect`
from .bootsteps import check_lock_store
from .conf import check_settings, flag, lock_url
from .exceptions import ConfigurationError
from .install import (
    METRICS_OPTION_NAME,
    RECOVER_OPTION_NAME,
    WORKER_OPTION_NAME,
    install,
    worker_options,
)
from .ops.web.command import web
from .ops_cli import COMMANDS
from .worker_ops import read_ops_settings

__all__ = ["redlock"]


@click.group(name="redlock")
def redlock() -> None:
    """Inspect celery-redlock's configuration and lock store."""


@redlock.command(cls=CeleryCommand)
@click.pass_context
def check(ctx: click.Context, /, **kwargs: Any) -> None:
    """Validate the redlock settings and ping the lock store; exit 1 on a bad setting."""
    app = ctx.obj.app
    try:
        queues = check_settings(app.conf)
        flag(app.conf, "redlock_recover_stale", True)
        flag(app.conf, "redlock_stats", True)
        read_ops_settings(app.conf)
        app.finalize()  # binds SingletonTasks, which validates their options
    except ConfigurationError as exc:
        click.echo(f"celery-redlock: configuration error: {exc}", err=True)
        sys.exit(1)
    click.echo(f"lock store: {lock_url(app.conf)}")
    click.echo(f"locked queues: {', '.join(sorted(queues)) or '(none)'}")
    click.echo(check_lock_store(app))


def _install_when_asked(sender: Any = None, **kwargs: Any) -> None:
    # worker_init comes right before the worker builds its bootsteps, so the
    # step added here still takes part. Only the CLI process connects this.
    app = sender.app
    options = sender.options
    asked = (
        options.get(WORKER_OPTION_NAME)
        or options.get(RECOVER_OPTION_NAME) is not None
        or options.get(METRICS_OPTION_NAME) is not None
    )
    if asked or app.conf.get("redlock_queues"):
        install(app)


for _command in (*COMMANDS, web):
    redlock.add_command(_command)
_known = {param.name for param in worker_command.params}
for _option in worker_options():
    if _option.name not in _known:
        worker_command.params.append(_option)
signals.worker_init.connect(_install_when_asked, weak=False, dispatch_uid="celery-redlock-install")
