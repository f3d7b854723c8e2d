"""The ``redlock_stats`` remote-control command: a worker's lock counters, on request.

Importing this module registers the command with Celery's worker control
panel (``celery.worker.control``). The worker imports it at start; the
``celery`` program imports it with the ``celery redlock`` plugin, so that
``celery inspect redlock_stats`` knows the command too. Ask with
``celery -A proj redlock stats`` or
``app.control.broadcast("redlock_stats", reply=True)``.
"""

from __future__ import annotations

from typing import Any

from celery.worker.control import inspect_command

from .stats import disabled_because, table_for

__all__ = ["STATS_COMMAND", "redlock_stats"]

#: The command's name.
STATS_COMMAND = "redlock_stats"


@inspect_command(name=STATS_COMMAND)  # type: ignore[untyped-decorator]
def redlock_stats(state: Any, **kwargs: Any) -> dict[str, Any]:
    """Reply with this worker's lock counters per task since it started."""
    table = table_for(state.app)
    if table is None:
        reason = disabled_because(state.app)
        if reason is not None:
            return {"error": f"celery-redlock: {reason}"}
        return {"error": "celery-redlock does not count on this worker (redlock_stats is off)"}
    return table.report()
