"""Prometheus metrics of celery-redlock, from workers' reports, in ``prometheus_client`` terms.

One function, :func:`families`, turns ``redlock_stats`` reports (see
:func:`celery_redlock.celery.control.redlock_stats`) into metric families, so the
dashboard's ``/metrics`` (every worker's report, labelled ``worker``) and a
worker's own endpoint (its report alone, started with
``--redlock-metrics-port``) export the same names:

==========================================  =========  ==========================================
name                                        type       meaning
==========================================  =========  ==========================================
``celery_redlock_acquired_total``           counter    calls that took their lock
``celery_redlock_skipped_total``            counter    duplicates skipped (a holder was running)
``celery_redlock_requeued_total``           counter    duplicates sent back to the queue
``celery_redlock_raised_total``             counter    duplicates failed with ``LockNotAcquired``
``celery_redlock_lost_total``               counter    locks lost while their task ran
``celery_redlock_released_total``           counter    locks released by their task
``celery_redlock_held_locks``               gauge      locks held by running tasks now
``celery_redlock_lock_wait_seconds``        histogram  task start to lock held, per acquisition
``celery_redlock_reaped_total``             counter    locks of dead holders freed by the reaper
``celery_redlock_reaper_passes_total``      counter    the reaper's passes over the lock store
==========================================  =========  ==========================================

Counters carry ``task`` (``reason`` for the reaper's), and are the sums over
a worker's pool processes. This module imports ``prometheus_client``: it is
loaded only where metrics are served (the ``web`` extra).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry

from .control import report_for
from .stats import COUNTERS

__all__ = ["COUNTER_HELP", "WorkerCollector", "families", "serve_worker_metrics"]

logger = logging.getLogger(__name__)

#: The help text of each outcome counter.
COUNTER_HELP = {
    "acquired": "Task calls that took their lock.",
    "skipped": "Duplicate calls skipped because another call held the lock.",
    "requeued": "Duplicate calls sent back to the queue because another call held the lock.",
    "raised": "Duplicate calls failed with LockNotAcquired.",
    "lost": "Locks lost (expired or taken) while their task ran.",
    "released": "Locks released by their task.",
}

Report = Mapping[str, Any]


def _labels(worker: str | None, *names: str) -> list[str]:
    return ["worker", *names] if worker is not None else list(names)


def _values(worker: str | None, *values: str) -> list[str]:
    return [worker, *values] if worker is not None else list(values)


def families(reports: Mapping[str | None, Report], *, by_worker: bool) -> list[Metric]:
    """Metric families of ``reports``: worker node name -> its ``redlock_stats`` reply.

    With ``by_worker`` every sample carries the node name as label ``worker``
    (the dashboard); without, there is one report, under ``None`` (a worker's
    own endpoint). A report holding an ``"error"`` (counting off) is left out.
    """
    reports = {node: r for node, r in reports.items() if isinstance(r, Mapping) and "tasks" in r}
    worker = "" if by_worker else None
    counters = {
        name: CounterMetricFamily(
            f"celery_redlock_{name}", COUNTER_HELP[name], labels=_labels(worker, "task")
        )
        for name in COUNTERS
    }
    held = GaugeMetricFamily(
        "celery_redlock_held_locks",
        "Locks held by running tasks now.",
        labels=_labels(worker, "task"),
    )
    wait = HistogramMetricFamily(
        "celery_redlock_lock_wait_seconds",
        "Seconds from the start of a task's run to holding its lock.",
        labels=_labels(worker, "task"),
    )
    reaped = CounterMetricFamily(
        "celery_redlock_reaped",
        "Locks of provably dead holders released by the worker's reaper.",
        labels=_labels(worker, "reason"),
    )
    passes = CounterMetricFamily(
        "celery_redlock_reaper_passes",
        "Passes of the worker's reaper over the lock store.",
        labels=_labels(worker),
    )
    for node, report in sorted(reports.items(), key=lambda item: item[0] or ""):
        label = node if by_worker else None
        _add_report(label, report, counters, held, wait, reaped)
        passes.add_metric(_values(label), int(report.get("reaper_passes") or 0))
    return [*counters.values(), held, wait, reaped, passes]


def _add_report(
    node: str | None,
    report: Report,
    counters: Mapping[str, CounterMetricFamily],
    held: GaugeMetricFamily,
    wait: HistogramMetricFamily,
    reaped: CounterMetricFamily,
) -> None:
    for task, counts in sorted((report.get("tasks") or {}).items()):
        for name, family in counters.items():
            family.add_metric(_values(node, task), int(counts.get(name, 0)))
    for task, count in sorted((report.get("held") or {}).items()):
        held.add_metric(_values(node, task), int(count))
    bounds: Sequence[float] = report.get("wait_buckets") or ()
    for task, histogram in sorted((report.get("wait") or {}).items()):
        edges = [f"{bound:g}" for bound in bounds] + ["+Inf"]
        buckets = list(zip(edges, (int(n) for n in histogram["buckets"])))
        wait.add_metric(_values(node, task), buckets, float(histogram["sum"]))
    for reason, count in sorted((report.get("reaped") or {}).items()):
        reaped.add_metric(_values(node, reason), int(count))


class WorkerCollector(Collector):
    """Collects one worker's metrics in its main process, at each scrape.

    Args:
        app: The worker's app.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        """Yield the metric families of this worker's current counts."""
        yield from families({None: report_for(self.app)}, by_worker=False)

    def describe(self) -> Iterable[Metric]:
        """Nothing: the registry must not collect at registration."""
        return []


def serve_worker_metrics(app: Any, host: str, port: int) -> Any:
    """Serve this worker's metrics at ``http://host:port/metrics``; return the server.

    Stop it with ``server.shutdown()`` then ``server.server_close()``.

    Raises:
        OSError: When the address cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(app))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    logger.info("celery-redlock: metrics at http://%s:%d/metrics", host, server.server_port)
    return server
