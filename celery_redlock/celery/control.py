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

from .stats import disabled_because, table_for

__all__ = ["STATS_COMMAND", "redlock_stats", "register"]

#: The command's name.
STATS_COMMAND = "redlock_stats"


def redlock_stats(state: Any, **kwargs: Any) -> dict[str, Any]:
    """Reply with this worker's lock counters per task since it started."""
    table = table_for(state.app)
    if table is None:
        reason = disabled_because(state.app)
        if reason is not None:
            return {"error": f"celery-redlock: {reason}"}
        return {"error": "celery-redlock does not count on this worker (redlock_stats is off)"}
    return table.report()


def register() -> None:
    """Add ``redlock_stats`` to Celery's control panel (once; later calls do nothing)."""
    if Panel.data.get(STATS_COMMAND) is not redlock_stats:
        inspect_command(name=STATS_COMMAND)(redlock_stats)
