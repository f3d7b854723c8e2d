"""Per-task lock counters, kept in the worker's memory and shared by its pool processes.

A prefork worker runs tasks in pool processes, but answers remote control in
its main process. So the counters live in one anonymous shared memory map
that the main process creates at worker start, before the pool forks: every
process writes its own row of cells (the main process row 0, pool process
*i* row *i* + 1, a replacement process taking over its predecessor's row),
and the main process sums the rows when asked. Counting is a few in-memory
additions per task: no Redis command, no message.

The counts follow celery-redlock's lock events (those of the signals
``lock_acquired``, ``lock_contended``, ``lock_released``, ``lock_lost``), taken
from the guard through :func:`~celery_redlock.celery.events.count_with`
hooks rather than as receivers, and start at zero when the worker starts.
Beside the :data:`COUNTERS`, :data:`WAIT_COUNTERS` measure fair requeue (see
docs/conflicts.md): how many calls were admitted after waiting in line, their
total and longest wait, and the longest line seen; the report adds each
task's mean and longest wait in seconds.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from ..core.forks import in_forked_children
from . import events

__all__ = [
    "COUNTERS",
    "OTHER_TASKS",
    "WAIT_BUCKETS",
    "WAIT_COUNTERS",
    "WAIT_TABLE_CELLS",
    "StatsTable",
    "count_waits",
    "disable",
    "disabled_because",
    "enable",
    "table_for",
    "wait_table_for",
]

logger = logging.getLogger(__name__)

#: The counters of each task, in cell order.
COUNTERS = ("acquired", "skipped", "requeued", "raised", "lost", "released")
#: What the wait line adds: calls admitted after waiting in line, their total
#: and longest wait (ms), and the most waiters seen in a key's line.
WAIT_COUNTERS = ("waited", "wait_ms", "wait_max_ms", "line_max")
#: Counters summed by their largest value, not their total.
_MAXIMA = frozenset({"wait_max_ms", "line_max"})
#: The row of tasks registered after the worker started.
OTHER_TASKS = "(other)"

_ACQUIRED, _SKIPPED, _REQUEUED, _RAISED, _LOST, _RELEASED = range(len(COUNTERS))
_WAITED, _WAIT_MS, _WAIT_MAX_MS, _LINE_MAX = range(len(COUNTERS), len(COUNTERS) + 4)
_BY_ACTION = {"skip": _SKIPPED, "requeue": _REQUEUED, "raise": _RAISED}
_CELL = 8  # bytes: unsigned 64-bit counters

#: Upper bounds (seconds) of the lock wait histogram's buckets; a last one is +Inf.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BUCKET_CELLS = len(WAIT_BUCKETS) + 1
_COUNT, _SUM_US, _TAKEN, _ENDED = range(_BUCKET_CELLS, _BUCKET_CELLS + 4)
#: The cells of a task's row in the metrics' wait table
#: (:class:`~celery_redlock.celery.metrics.WaitTable`): the hook that counts an
#: acquisition writes them beside this module's counters.
WAIT_TABLE_CELLS = (
    *(f"le_{bound:g}" for bound in WAIT_BUCKETS),
    "le_inf",
    "count",
    "sum_us",
    "taken",
    "ended",
)


def _process_index() -> int | None:
    # billiard numbers its pool processes 0..n-1 and gives a replacement the
    # number of the process it replaces; the main process has none.
    try:
        from billiard.process import current_process
    except ImportError:  # pragma: no cover - celery always brings billiard
        return None
    index = getattr(current_process(), "index", None)
    return index if isinstance(index, int) else None


class StatsTable:
    """Counters per task and process, in memory shared with forked processes.

    Args:
        tasks: The task names to count (others share one row).
        processes: How many pool processes may write at once.
        counters: The names of each task's cells (default: :data:`COUNTERS`).
    """

    def __init__(
        self,
        tasks: Iterable[str],
        processes: int,
        counters: Sequence[str] = (*COUNTERS, *WAIT_COUNTERS),
    ) -> None:
        self.tasks = [*sorted(set(tasks) - {OTHER_TASKS}), OTHER_TASKS]
        self.counters = tuple(counters)
        self._rows = {name: i for i, name in enumerate(self.tasks)}
        self.slots = max(1, processes) + 1
        # Registered before the first table's own fork hook, hence run before
        # it in a child: the table takes the child's new lock.
        in_forked_children(_after_fork_in_child)
        self.started_at = time.time()
        self._width = len(self.tasks) * len(self.counters)
        # mmap(-1, n) is anonymous and MAP_SHARED: forked children write the
        # very pages the parent reads.
        self._memory = mmap.mmap(-1, self.slots * self._width * _CELL)
        self._cells = memoryview(self._memory).cast("Q")
        self._reset_process()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reset_if_alive(ref))

    def _reset_process(self) -> None:
        # Threads of one process (threads pool, the watchdog) share its row;
        # every table of the process writes under one lock, so an event's hook
        # updates them all under one (renewed in a fork's child before this runs).
        self._lock = _writes
        # Found on first use: right after a fork billiard has not yet told the
        # child which pool process it is.
        self._base: int | None = None
        # Task name -> its first cell in this process's slot, once known.
        self._starts: dict[str, int] = {}

    def _own_base(self) -> int:
        index = _process_index()
        slot = 0 if index is None else 1 + index % (self.slots - 1)
        self._base = slot * self._width
        return self._base

    def _row_start(self, task: str) -> int:
        """The index of ``task``'s first cell in this process's slot."""
        start = self._starts.get(task)
        if start is not None:
            return start
        row = self._rows.get(task)
        if row is None:
            row = self._rows[OTHER_TASKS]
        base = self._base if self._base is not None else self._own_base()
        start = base + row * len(self.counters)
        if row != self._rows[OTHER_TASKS]:  # only names with a row: the cache stays bounded
            self._starts[task] = start
        return start

    def add(self, task: str, counter: int, amount: int = 1) -> None:
        """Add ``amount`` to ``counter`` (an index into :attr:`counters`) of ``task``."""
        # Every task adds twice or more: its start, when known, without a call.
        start = self._starts.get(task)
        if start is None:
            start = self._row_start(task)
        with self._lock:
            self._cells[start + counter] += amount

    def raise_to(self, task: str, counter: int, value: int) -> None:
        """Raise ``counter`` of ``task`` to ``value`` if it is below (a maximum, not a count)."""
        cell = self._row_start(task) + counter
        with self._lock:
            if self._cells[cell] < value:
                self._cells[cell] = value

    def totals(self) -> dict[str, dict[str, int]]:
        """Return the sums over every process, per task; tasks never counted are left out."""
        result: dict[str, dict[str, int]] = {}
        cells = self._cells
        width = len(self.counters)
        for row, task in enumerate(self.tasks):
            sums = [0] * width
            for slot in range(self.slots):
                start = slot * self._width + row * width
                for i in range(width):
                    if self.counters[i] in _MAXIMA:
                        sums[i] = max(sums[i], cells[start + i])
                    else:
                        sums[i] += cells[start + i]
            if any(sums):
                result[task] = dict(zip(self.counters, sums))
        return result

    def report(self) -> dict[str, Any]:
        """What the ``redlock_stats`` remote-control command replies."""
        tasks = self.totals()
        for counts in tasks.values():
            waited = counts.get("waited", 0)
            if waited:
                counts["wait_mean_s"] = round(counts["wait_ms"] / waited / 1000, 3)  # type: ignore[assignment]
                counts["wait_longest_s"] = round(counts["wait_max_ms"] / 1000, 3)  # type: ignore[assignment]
        return {
            "since": self.started_at,
            "pid": os.getpid(),
            "processes": self.slots - 1,
            "tasks": tasks,
        }


def _reset_if_alive(ref: weakref.ref[StatsTable]) -> None:
    table = ref()
    if table is not None:
        table._reset_process()


# Every counter write of this process is made under this lock: the threads
# pool runs tasks concurrently, and ``cells[i] += n`` is a read and a write.
_writes = threading.Lock()
_tables: weakref.WeakKeyDictionary[Any, StatsTable] = weakref.WeakKeyDictionary()
_wait_tables: weakref.WeakKeyDictionary[Any, StatsTable] = weakref.WeakKeyDictionary()
_disabled: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
# Task -> (counter cells or None, its row's start, wait cells or None, its row's
# start) in this process: found on a task's first event, so that an event after
# it costs one dict lookup. Emptied whenever a table is enabled or disabled,
# and in a fork's child (whose row is another).
_rows: dict[Any, tuple[Any, int, Any, int]] = {}


def _after_fork_in_child() -> None:
    global _writes
    _writes = threading.Lock()
    _rows.clear()


def table_for(app: Any) -> StatsTable | None:
    """Return the counters of ``app``'s worker in this process, if counting is on."""
    return _tables.get(app)


def enable(app: Any, processes: int) -> StatsTable:
    """Start counting the lock outcomes of ``app``'s tasks in this process and its forks.

    Call it in the worker's main process before the pool starts; a later call
    starts the counts afresh.
    """
    _disabled.pop(app, None)
    table = _tables[app] = StatsTable(app.tasks.keys(), processes)
    _rows.clear()
    events.count_with(_COUNTERS)
    return table


def count_waits(app: Any, table: StatsTable) -> None:
    """Write each acquisition's wait and each hold of ``app``'s tasks to ``table`` too.

    ``table`` has the :data:`WAIT_TABLE_CELLS`; the metrics call this from
    :func:`celery_redlock.celery.metrics.enable`.
    """
    _wait_tables[app] = table
    _rows.clear()
    events.count_with(_COUNTERS)


def wait_table_for(app: Any) -> StatsTable | None:
    """Return the table :func:`count_waits` writes ``app``'s waits to, if any."""
    return _wait_tables.get(app)


def disable(app: Any, reason: str) -> None:
    """Stop counting for ``app``'s worker in this process, and remember why."""
    _tables.pop(app, None)
    _rows.clear()
    _disabled[app] = reason


def disabled_because(app: Any) -> str | None:
    """Return why :func:`disable` turned counting off for ``app``, if it did."""
    return _disabled.get(app)


def _table_of(task: Any) -> StatsTable | None:
    app = getattr(task, "app", None)
    return _tables.get(app) if app is not None else None


def _count(task: Any, counter: int) -> None:
    table = _table_of(task)
    if table is not None:
        table.add(task.name, counter)


def _find_rows(task: Any) -> tuple[Any, int, Any, int]:
    app = getattr(task, "app", None)
    counts = _tables.get(app) if app is not None else None
    waits = _wait_tables.get(app) if app is not None else None
    found = (
        None if counts is None else counts._cells,
        0 if counts is None else counts._row_start(task.name),
        None if waits is None else waits._cells,
        0 if waits is None else waits._row_start(task.name),
    )
    _rows[task] = found
    return found


def _on_acquired(task: Any, started: float | None, waited: float | None) -> None:
    # Every task passes here: both tables' cells from one lookup, under one lock.
    counts, at, waits, wait_at = _rows.get(task) or _find_rows(task)
    if waits is not None and started is not None:  # None: a guard that did not time its run
        seconds = time.monotonic() - started
        # bisect_left: the first bound >= seconds (len(WAIT_BUCKETS), +Inf, past them all).
        bucket = wait_at + bisect.bisect_left(WAIT_BUCKETS, seconds)
        wait_us = max(0, round(seconds * 1_000_000))
    with _writes:
        if counts is not None:
            counts[at + _ACQUIRED] += 1
            if waited is not None:
                ms = int(waited * 1000)
                counts[at + _WAITED] += 1
                counts[at + _WAIT_MS] += ms
                if counts[at + _WAIT_MAX_MS] < ms:
                    counts[at + _WAIT_MAX_MS] = ms
        if waits is not None:
            if started is not None:
                waits[bucket] += 1
                waits[wait_at + _COUNT] += 1
                waits[wait_at + _SUM_US] += wait_us
            waits[wait_at + _TAKEN] += 1


def _on_contended(task: Any, action: str, line: int | None) -> None:
    counter = _BY_ACTION.get(action)
    if counter is not None:
        _count(task, counter)
    if line:
        table = _table_of(task)
        if table is not None:
            table.raise_to(task.name, _LINE_MAX, line)


def _on_released(task: Any, owned: bool) -> None:
    counts, at, waits, wait_at = _rows.get(task) or _find_rows(task)
    with _writes:
        # A lock found lost at release was not released by this task, but its hold ended.
        if owned and counts is not None:
            counts[at + _RELEASED] += 1
        if waits is not None:
            waits[wait_at + _ENDED] += 1


def _on_lost(task: Any) -> None:
    _count(task, _LOST)


_COUNTERS = events.Counters(_on_acquired, _on_contended, _on_released, _on_lost)
