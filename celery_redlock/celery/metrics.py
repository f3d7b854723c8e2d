"""Lock wait times, held locks and reaped locks of one worker, shared by its pool processes.

The outcome counters live in :mod:`celery_redlock.celery.stats`; this module adds,
in a second table of the same shared memory design (one row of cells per
process, summed when read), what the Prometheus metrics need besides them:

* the **lock wait** of each acquisition: seconds from the start of the task's
  run (the guard's first step, just after ``task_prerun``) to holding its
  lock, the acquire round trip (a quorum on Redlock, the handover of an
  enqueue reservation) in a histogram;
* the **held locks**: acquisitions minus releases. A pool process killed
  while it holds a lock leaves its count behind; the process that takes its
  place (billiard gives it the same index, hence the same row) clears it, so
  the gauge counts locks held by running tasks only;
* the locks the reaper (:mod:`celery_redlock.celery.reaper`) released, by reason,
  counted in the main process where the reaper runs.

Nothing here talks to Redis: an acquisition costs a few in-memory additions.
:func:`worker_report` is what the ``redlock_stats`` remote-control command
adds to the counters, and what the worker's ``/metrics`` endpoint reads
(:mod:`celery_redlock.celery.prometheus`).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from typing import Any

from . import stats
from .reaper import REASONS
from .stats import (
    _BUCKET_CELLS,
    _COUNT,
    _ENDED,
    _SUM_US,
    _TAKEN,
    WAIT_BUCKETS,
    WAIT_TABLE_CELLS,
    StatsTable,
)

__all__ = [
    "WAIT_BUCKETS",
    "WaitTable",
    "count_reaped",
    "count_reaper_pass",
    "enable",
    "worker_report",
]


class WaitTable(StatsTable):
    """Per task and process: the lock wait histogram's cells and the holds taken and ended.

    Args:
        tasks: The task names to count (others share one row).
        processes: How many pool processes may write at once.
    """

    def __init__(self, tasks: Any, processes: int) -> None:
        super().__init__(tasks, processes, WAIT_TABLE_CELLS)

    def _own_base(self) -> int:
        base = super()._own_base()
        if base:
            # A pool process taking over a row: holds its predecessor did not
            # end died with it. Writing to its own row needs no lock.
            width = len(self.counters)
            for row in range(len(self.tasks)):
                start = base + row * width
                self._cells[start + _ENDED] = self._cells[start + _TAKEN]
        return base

    def observe(self, task: str, seconds: float, taken: bool = False) -> None:
        """Record one acquisition after waiting ``seconds`` for it (and its hold, if ``taken``)."""
        # bisect_left: the first bound >= seconds (len(WAIT_BUCKETS), +Inf, past them all).
        bucket = bisect.bisect_left(WAIT_BUCKETS, seconds)
        wait_us = max(0, round(seconds * 1_000_000))
        start = self._row_start(task)
        cells = self._cells
        # add_many's work, written out: once per task, under one lock.
        with self._lock:
            cells[start + bucket] += 1
            cells[start + _COUNT] += 1
            cells[start + _SUM_US] += wait_us
            if taken:
                cells[start + _TAKEN] += 1

    def taken(self, task: str) -> None:
        """Record the start of one hold."""
        self.add(task, _TAKEN)

    def ended(self, task: str) -> None:
        """Record the end of one hold (released, or found lost at release)."""
        self.add(task, _ENDED)

    def snapshot(self) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        """Return ``(wait histogram per task, held locks per task)`` summed over processes.

        A histogram is ``{"buckets": cumulative counts per bound, +Inf last,
        "count": n, "sum": seconds}``.
        """
        wait: dict[str, dict[str, Any]] = {}
        held: dict[str, int] = {}
        for task, cells in self.totals().items():
            counts = [cells[name] for name in WAIT_TABLE_CELLS[:_BUCKET_CELLS]]
            cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
            if cells["count"]:
                wait[task] = {
                    "buckets": cumulative,
                    "count": cells["count"],
                    "sum": cells["sum_us"] / 1_000_000,
                }
            held[task] = max(0, cells["taken"] - cells["ended"])
        return wait, held


_reaped: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_passes: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_reaped_guard = threading.Lock()


def enable(app: Any, processes: int) -> WaitTable:
    """Start measuring ``app``'s lock waits and holds in this process and its forks.

    Call it in the worker's main process before the pool starts, as
    :func:`celery_redlock.celery.stats.enable`.
    """
    table = WaitTable(app.tasks.keys(), processes)
    # The counters' own hooks write it: one hook per event for both tables.
    stats.count_waits(app, table)
    return table


def count_reaped(app: Any, reason: str) -> None:
    """Count one lock the reaper of ``app``'s worker released for ``reason``."""
    with _reaped_guard:
        counts = _reaped.setdefault(app, dict.fromkeys(REASONS, 0))
        counts[reason] = counts.get(reason, 0) + 1


def count_reaper_pass(app: Any) -> None:
    """Count one pass of the reaper of ``app``'s worker over the lock store."""
    with _reaped_guard:
        _passes[app] = _passes.get(app, 0) + 1


def worker_report(app: Any) -> dict[str, Any]:
    """What this worker adds to the ``redlock_stats`` reply: waits, held and reaped locks.

    ``{"wait": {task: histogram}, "held": {task: n}, "reaped": {reason: n},
    "reaper_passes": n, "wait_buckets": bounds}``; the first two are empty
    when counting is off.
    """
    table = stats.wait_table_for(app)
    wait, held = table.snapshot() if isinstance(table, WaitTable) else ({}, {})
    with _reaped_guard:
        reaped = dict(_reaped.get(app) or dict.fromkeys(REASONS, 0))
        passes = _passes.get(app, 0)
    return {
        "wait": wait,
        "held": held,
        "reaped": reaped,
        "reaper_passes": passes,
        "wait_buckets": list(WAIT_BUCKETS),
    }
