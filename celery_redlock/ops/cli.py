"""The ``celery redlock`` commands, and the worker options of celery-redlock.

Celery loads ``redlock`` (the command group) through the ``celery.commands`` entry point
whenever the ``celery`` program starts, before it loads the app. Importing
this module changes nothing; loading ``redlock`` from it (as the entry point
does) calls :func:`plug_in`, which adds the worker options to ``celery
worker`` (``--redlock-queues``, ``--redlock-recover``,
``--redlock-metrics-port``), registers the ``redlock_stats`` inspect command,
and installs celery-redlock in any worker started with one of the options or
with ``redlock_queues`` configured. The operator commands (``list``, ``show``,
``release``, ``purge``, ``stats``) live in :mod:`celery_redlock.ops.commands`,
the dashboard (``web``) in :mod:`celery_redlock.ops.web`.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

import click
from celery import signals
from celery.bin.base import CeleryCommand
from celery.bin.worker import worker as worker_command

from celery_redlock.celery import control
from celery_redlock.celery.install import (
    METRICS_OPTION_NAME,
    RECOVER_OPTION_NAME,
    WORKER_OPTION_NAME,
    install,
    worker_options,
)
from celery_redlock.celery.settings import check_settings, flag
from celery_redlock.celery.worker_ops import read_ops_settings
from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.health import check_store
from celery_redlock.core.recovery import lock_prefixes
from celery_redlock.core.store import store_for

from .commands import COMMANDS
from .web.command import web

# ``redlock``, the command group, is read through __getattr__ (see the end).
__all__ = ["plug_in"]


@click.command(cls=CeleryCommand)
@click.pass_context
def check(ctx: click.Context, /, **kwargs: Any) -> None:
    """Validate the redlock settings and run the lock scripts on every lock store master.

    Exit status 0 with a short summary when every setting is valid and
    acquire, renew and release ran under each key prefix on every master;
    otherwise 1, with one line on stderr saying why (with the store error's
    cause). Fit for a readiness probe.
    """
    app = ctx.obj.app
    try:
        queues = check_settings(app.conf)
        flag(app.conf, "redlock_recover_stale", True)
        flag(app.conf, "redlock_stats", True)
        read_ops_settings(app.conf)
        app.finalize()  # binds SingletonTasks, which validates their options
        result = check_store(store_for(app), lock_prefixes(app))
    except ConfigurationError as exc:
        click.echo(f"celery-redlock: configuration error: {exc}", err=True)
        sys.exit(1)
    if not result.ok:
        click.echo(f"celery-redlock: {result.failure()}", err=True)
        sys.exit(1)
    click.echo(result.summary())
    click.echo(f"locked queues: {', '.join(sorted(queues)) or '(none)'}")


_group = click.Group(
    name="redlock",
    commands=[check, *COMMANDS, web],
    help="Inspect celery-redlock's configuration and lock store.",
)


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


def _reports_configuration_errors(command: click.Command) -> None:
    """Make ``command`` end on a :class:`ConfigurationError` with one line and exit status 1.

    The error names the setting and its value, which is all an operator
    needs; Celery would print some sixty lines of traceback through its app
    loading. ``-l DEBUG`` (``--loglevel``) keeps the traceback.
    """
    callback = command.callback
    if callback is None or getattr(callback, "_redlock_reports", False):
        return

    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except ConfigurationError as exc:
            level = kwargs.get("loglevel")
            if isinstance(level, int) and level <= logging.DEBUG:
                raise
            click.echo(f"celery-redlock: configuration error: {exc}", err=True)
            sys.exit(1)

    run._redlock_reports = True  # type: ignore[attr-defined]
    command.callback = run


def plug_in() -> click.Group:
    """Plug celery-redlock into the ``celery`` program; return the ``celery redlock`` group.

    Adds ``--redlock-queues`` and ``--redlock-recover/--no-redlock-recover``
    to ``celery worker``, registers the ``redlock_stats`` inspect command and
    connects the ``worker_init`` handler that installs celery-redlock in a
    worker started with either option or with ``redlock_queues`` configured.
    A configuration error at worker start then ends ``celery worker`` with
    one line naming the setting (the traceback only with ``-l DEBUG``).
    The ``celery.commands`` entry point does this by loading ``redlock``;
    calling it again does nothing.
    """
    _reports_configuration_errors(worker_command)
    known = {param.name for param in worker_command.params}
    for option in worker_options():
        if option.name not in known:
            worker_command.params.append(option)
    control.register()
    signals.worker_init.connect(
        _install_when_asked, weak=False, dispatch_uid="celery-redlock-install"
    )
    return _group


def __getattr__(name: str) -> Any:
    # ``redlock`` is what the entry point loads: plugging in happens then, not
    # when something merely imports this module.
    if name == "redlock":
        return plug_in()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
