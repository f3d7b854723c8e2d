"""The ``redlock_stats`` remote-control command: a worker's lock counters, on request.

:func:`register` adds the command to Celery's worker control panel
(``celery.worker.control``); importing this module registers nothing. The
worker's bootstep registers it at start, and the ``celery redlock`` plugin
when the ``celery`` program loads it, so that ``celery inspect redlock_stats``
knows the command too. Ask with ``celery -A proj redlock stats`` or
``app.control.broadcast("redlock_stats", reply=True)``.
"""

from __future__ import annotations

from typing import Any

from celery.worker.control import Panel, inspect_command

from .metrics import worker_report
from .rates import history_for
from .stats import disabled_because, table_for

__all__ = ["STATS_COMMAND", "redlock_stats", "register", "report_for"]

#: The command's name.
STATS_COMMAND = "redlock_stats"


def report_for(app: Any) -> dict[str, Any]:
    """This process's report of ``app``'s worker: what ``redlock_stats`` replies.

    The counters per task since the worker started and, besides them, lock
    waits, held and reaped locks (:func:`celery_redlock.celery.metrics.worker_report`)
    and, when the worker keeps it, the last hour of counts minute by minute
    (``history``, see :mod:`celery_redlock.celery.rates`). ``{"error": why}``
    when the worker does not count.
    """
    table = table_for(app)
    if table is None:
        reason = disabled_because(app)
        if reason is not None:
            return {"error": f"celery-redlock: {reason}"}
        return {"error": "celery-redlock does not count on this worker (redlock_stats is off)"}
    report = {**table.report(), **worker_report(app)}
    history = history_for(app)
    if history is not None:
        report["history"] = history.report()
    return report


def redlock_stats(state: Any, **kwargs: Any) -> dict[str, Any]:
    """Reply with this worker's lock counters per task since it started (see :func:`report_for`)."""
    return report_for(state.app)


def register() -> None:
    """Add ``redlock_stats`` to Celery's control panel (once; later calls do nothing)."""
    if Panel.data.get(STATS_COMMAND) is not redlock_stats:
        inspect_command(name=STATS_COMMAND)(redlock_stats)
