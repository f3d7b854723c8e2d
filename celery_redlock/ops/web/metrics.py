"""The dashboard's ``/metrics``: every worker's counters, labelled, and what the store holds.

The workers' counters are asked by remote control at each scrape (as the
stats page does) and exported under the names of
:mod:`celery_redlock.celery.prometheus`, with a ``worker`` label. The store adds
``celery_redlock_store_keys{task, kind}``: the locks and enqueue reservations
it holds now, counted with ``SCAN`` (key names only, no value read).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from celery_redlock.celery.prometheus import families
from celery_redlock.core.inventory import RESERVATION_SUFFIX, lock_pattern, parse_key

from .activity import collect
from .dashboard import Dashboard

__all__ = ["count_keys", "metrics_body"]

#: ``SCAN``'s COUNT hint when counting keys.
SCAN_COUNT = 1000


def count_keys(nodes: list[Any], prefixes: list[str]) -> Counter[tuple[str, str]]:
    """Count the locks and reservations per (task, kind) on ``nodes``, each key once.

    Raises:
        redis.exceptions.RedisError: When a node fails.
    """
    seen: set[str] = set()
    counts: Counter[tuple[str, str]] = Counter()
    for prefix in dict.fromkeys(prefixes):
        for node in nodes:
            for raw in node.scan_iter(match=lock_pattern(prefix), count=SCAN_COUNT):
                key = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
                parsed = parse_key(key, reservations=True)
                if parsed is None or parsed[0] != prefix or key in seen:
                    continue
                seen.add(key)
                kind = "reservation" if key.endswith(RESERVATION_SUFFIX) else "lock"
                counts[(parsed[1], kind)] += 1
    return counts


class _Snapshot(Collector):
    """Hands the registry families built for one scrape."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """Yield the families."""
        return iter(self.metrics)

    def describe(self) -> list[Metric]:
        """Nothing: the families are built per scrape."""
        return []


def metrics_body(dash: Dashboard) -> tuple[bytes, str]:
    """Return the text of one scrape and its content type.

    A worker that does not answer is left out; a store or broker that fails
    is reported by ``celery_redlock_dashboard_up{source}`` = 0.
    """
    up = GaugeMetricFamily(
        "celery_redlock_dashboard_up",
        "Whether the dashboard could read the source at this scrape.",
        labels=["source"],
    )
    reports: dict[str | None, Any] = {}
    try:
        activity = collect(dash.app, dash.ping_timeout)
        reports.update(activity.reports)
        up.add_metric(["workers"], 1)
    except Exception:  # the broker is down: the store's side is still worth a scrape
        up.add_metric(["workers"], 0)
    store = GaugeMetricFamily(
        "celery_redlock_store_keys",
        "Locks (kind=lock) and enqueue reservations (kind=reservation) in the store now.",
        labels=["task", "kind"],
    )
    try:
        for (task, kind), count in sorted(count_keys(dash.nodes(), dash.prefixes()).items()):
            store.add_metric([task, kind], count)
        up.add_metric(["store"], 1)
    except Exception:  # RedisError, or a Cluster that cannot be discovered
        up.add_metric(["store"], 0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot([*families(reports, by_worker=True), store, up]))
    return generate_latest(registry), CONTENT_TYPE_LATEST
