"""The ``celery redlock`` commands, and the ``--redlock-queues`` worker option.

Celery loads this module through the ``celery.commands`` entry point whenever
the ``celery`` program starts, before it loads the app. It then adds the
worker option to ``celery worker`` and installs celery-redlock in any worker
started with that option or with ``redlock_queues`` configured.
"""

from __future__ import annotations

import sys
from typing import Any

import click
from celery import signals
from celery.bin.base import CeleryCommand
from celery.bin.worker import worker as worker_command

from .bootsteps import check_lock_store
from .conf import check_settings, lock_url
from .exceptions import ConfigurationError
from .install import WORKER_OPTION_NAME, install, worker_option

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
    if sender.options.get(WORKER_OPTION_NAME) or app.conf.get("redlock_queues"):
        install(app)


if not any(param.name == WORKER_OPTION_NAME for param in worker_command.params):
    worker_command.params.append(worker_option())
signals.worker_init.connect(_install_when_asked, weak=False, dispatch_uid="celery-redlock-install")
