"""The last hour of a worker's lock counters, minute by minute, for the dashboard's chart.

The worker's main process takes a sample of the counters
(:mod:`celery_redlock.celery.stats`) once a minute from its own timer and keeps what
changed since the previous sample: an interval in which nothing happened
costs one timestamp. The ``redlock_stats`` remote-control command returns the
kept intervals plus the current, unfinished one, so a dashboard started just
now still charts the hour behind it. Nothing is written to Redis.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from .stats import COUNTERS, StatsTable

__all__ = ["HISTORY_SECONDS", "SAMPLE_SECONDS", "RateHistory", "enable", "history_for"]

#: Seconds between two samples.
SAMPLE_SECONDS = 60.0
#: Seconds of history kept.
HISTORY_SECONDS = 3600.0

Totals = Mapping[str, Mapping[str, int]]


def _delta(now: Totals, before: Totals) -> dict[str, dict[str, int]]:
    changed: dict[str, dict[str, int]] = {}
    for task, counts in now.items():
        previous = before.get(task, {})
        diff = {name: counts[name] - previous.get(name, 0) for name in COUNTERS}
        diff = {name: value for name, value in diff.items() if value}
        if diff:
            changed[task] = diff
    return changed


class RateHistory:
    """Samples ``table``'s totals; keeps the changes of the last hour.

    Args:
        table: The worker's counters.
        clock: Wall clock in seconds (the chart's time axis).
    """

    def __init__(self, table: StatsTable, clock: Callable[[], float] = time.time) -> None:
        self._table = table
        self._clock = clock
        self._guard = threading.Lock()
        self._last_time = clock()
        self._last: Totals = table.totals()
        self._intervals: deque[dict[str, Any]] = deque()

    def sample(self) -> None:
        """Close the current interval: keep what changed in it, drop what is over an hour old."""
        now, totals = self._clock(), self._table.totals()
        with self._guard:
            self._intervals.append(self._interval(now, totals))
            self._last_time, self._last = now, totals
            while self._intervals and self._intervals[0]["end"] < now - HISTORY_SECONDS:
                self._intervals.popleft()

    def _interval(self, now: float, totals: Totals) -> dict[str, Any]:
        return {"start": self._last_time, "end": now, "tasks": _delta(totals, self._last)}

    def report(self) -> list[dict[str, Any]]:
        """The kept intervals, oldest first, then the current one up to now.

        Each is ``{"start": unix time, "end": unix time, "tasks": {task:
        {counter: events}}}``, counters that did not change left out.
        """
        now, totals = self._clock(), self._table.totals()
        with self._guard:
            return [*self._intervals, self._interval(now, totals)]


_histories: weakref.WeakKeyDictionary[Any, RateHistory] = weakref.WeakKeyDictionary()


def enable(app: Any, table: StatsTable) -> RateHistory:
    """Keep the history of ``table``, the counters of ``app``'s worker; return it."""
    history = _histories[app] = RateHistory(table)
    return history


def history_for(app: Any) -> RateHistory | None:
    """Return the history of ``app``'s worker counters, if kept in this process."""
    return _histories.get(app)
