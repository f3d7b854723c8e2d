"""The stats page's data: every worker's counters, asked by remote control, and their last hour.

The workers answer ``redlock_stats`` (see :mod:`celery_redlock.celery.control`)
with their counters per task and, minute by minute, what changed in the last
hour (:mod:`celery_redlock.celery.rates`). This module sums the first per task and
per worker and puts the second on one time axis: events per minute, for each
counter, over the last 60 minutes, all workers (or one task) together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_redlock.celery.control import STATS_COMMAND
from celery_redlock.celery.stats import COUNTERS

__all__ = ["MINUTES", "Activity", "collect", "per_minute"]

#: Minutes the chart covers.
MINUTES = 60


@dataclass
class Activity:
    """What the workers told.

    Attributes:
        reports: Worker node -> its ``redlock_stats`` reply (counting ones).
        errors: Worker node -> why it does not count.
        by_task: Task -> counter -> sum over workers.
        by_worker: Worker node -> counter -> sum over tasks.
    """

    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    by_task: dict[str, dict[str, int]] = field(default_factory=dict)
    by_worker: dict[str, dict[str, int]] = field(default_factory=dict)


def collect(app: Any, timeout: float) -> Activity:
    """Ask every live worker of ``app`` for its counters and sum them.

    Raises:
        Exception: Whatever the broker connection raises.
    """
    replies = app.control.broadcast(STATS_COMMAND, reply=True, timeout=timeout) or ()
    activity = Activity()
    for reply in replies:
        for node, report in reply.items():
            if isinstance(report, dict) and "tasks" in report:
                activity.reports[node] = report
            else:
                error = report.get("error") if isinstance(report, dict) else report
                activity.errors[node] = str(error)
    for node, report in sorted(activity.reports.items()):
        worker = activity.by_worker.setdefault(node, dict.fromkeys(COUNTERS, 0))
        for task, counts in (report.get("tasks") or {}).items():
            row = activity.by_task.setdefault(task, dict.fromkeys(COUNTERS, 0))
            for name in COUNTERS:
                value = int(counts.get(name, 0))
                row[name] += value
                worker[name] += value
            # Fair requeue: the longest any call of the task waited in line.
            row["wait_max_ms"] = max(row.get("wait_max_ms", 0), int(counts.get("wait_max_ms", 0)))
    return activity


def _shares(start: float, end: float, now: float) -> list[tuple[int, float]]:
    """The minute slots an interval overlaps, each with the share of the interval it holds."""
    origin = now - MINUTES * 60
    if end <= start:
        slot = math.floor((end - origin) / 60)
        return [(min(slot, MINUTES - 1), 1.0)] if slot >= 0 else []
    shares = []
    first = max(0, math.floor((start - origin) / 60))
    last = min(MINUTES - 1, math.floor((end - origin) / 60))
    for slot in range(first, last + 1):
        low, high = origin + slot * 60, origin + (slot + 1) * 60
        overlap = min(end, high) - max(start, low)
        if overlap > 0:
            shares.append((slot, overlap / (end - start)))
    return shares


def per_minute(
    reports: Mapping[str, Mapping[str, Any]], now: float, task: str | None = None
) -> dict[str, list[float]]:
    """Events per minute of each counter over the last :data:`MINUTES` minutes, oldest first.

    The events of each interval of a worker's history are spread evenly over
    the minutes it covers. ``task`` keeps one task.
    """
    series = {name: [0.0] * MINUTES for name in COUNTERS}
    for report in reports.values():
        for interval in report.get("history") or ():
            shares = _shares(float(interval["start"]), float(interval["end"]), now)
            for name_of_task, counts in (interval.get("tasks") or {}).items():
                if task is not None and name_of_task != task:
                    continue
                for name, value in counts.items():
                    for slot, share in shares if name in series else ():
                        series[name][slot] += float(value) * share
    return series
