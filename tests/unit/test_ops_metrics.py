"""Worker-side metrics: the wait/held table, the rate history, Prometheus families, settings."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_redlock.celery.metrics import WAIT_BUCKETS, WaitTable
from celery_redlock.celery.prometheus import families
from celery_redlock.celery.rates import RateHistory
from celery_redlock.celery.stats import StatsTable
from celery_redlock.celery.worker_ops import OpsSettings, read_ops_settings
from celery_redlock.core.exceptions import ConfigurationError


def exposition(metrics) -> str:
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import Collector, CollectorRegistry

    class Fixed(Collector):
        def collect(self):
            return iter(metrics)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_wait_table_builds_a_cumulative_histogram_and_counts_held_locks():
    """Waits land in the first bucket that holds them; held = taken minus ended."""
    table = WaitTable(["a"], processes=2)
    for seconds in (0.0005, 0.003, 0.003, 20.0):
        table.taken("a")
        table.observe("a", seconds)
    table.ended("a")
    wait, held = table.snapshot()
    buckets = wait["a"]["buckets"]
    assert len(buckets) == len(WAIT_BUCKETS) + 1
    assert buckets[0] == 1  # <= 1 ms
    assert buckets[WAIT_BUCKETS.index(0.005)] == 3
    assert buckets[-2] == 3 and buckets[-1] == 4  # 20 s only in +Inf
    assert wait["a"]["count"] == 4
    assert wait["a"]["sum"] == pytest.approx(20.0065)
    assert held == {"a": 3}


def test_rate_history_keeps_only_changes_and_the_last_hour():
    """Each sample keeps what changed since the previous one; intervals over an hour old go."""
    now = [0.0]
    table = StatsTable(["a", "b"], processes=1)
    history = RateHistory(table, clock=lambda: now[0])
    table.add("a", 0)
    table.add("a", 0)
    now[0] = 60.0
    history.sample()
    now[0] = 120.0
    history.sample()  # nothing happened
    table.add("b", 1)
    now[0] = 150.0
    intervals = history.report()
    assert intervals[0] == {"start": 0.0, "end": 60.0, "tasks": {"a": {"acquired": 2}}}
    assert intervals[1] == {"start": 60.0, "end": 120.0, "tasks": {}}
    assert intervals[2] == {"start": 120.0, "end": 150.0, "tasks": {"b": {"skipped": 1}}}
    now[0] = 60.0 + 3600.0 + 61.0
    history.sample()
    assert [i["start"] for i in history.report()][:1] == [120.0]


def report(acquired: int, reaped: int = 0) -> dict:
    return {
        "tasks": {"app.t": {"acquired": acquired, "released": acquired - 1}},
        "held": {"app.t": 1},
        "wait": {"app.t": {"buckets": [1] * len(WAIT_BUCKETS) + [2], "count": 2, "sum": 0.5}},
        "wait_buckets": list(WAIT_BUCKETS),
        "reaped": {"pid_gone": reaped, "worker_silent": 0},
        "reaper_passes": 3,
    }


def test_families_are_named_by_prometheus_conventions_and_parse_back():
    """Counters end in _total, the wait histogram has buckets, and a worker label when asked."""
    text = exposition(
        families({"w1": report(5, 2), "w2": report(3), "off": {"error": "x"}}, by_worker=True)
    )
    found = samples(text)
    assert found[("celery_redlock_acquired_total", (("task", "app.t"), ("worker", "w1")))] == 5
    assert found[("celery_redlock_acquired_total", (("task", "app.t"), ("worker", "w2")))] == 3
    assert found[("celery_redlock_released_total", (("task", "app.t"), ("worker", "w1")))] == 4
    assert found[("celery_redlock_held_locks", (("task", "app.t"), ("worker", "w1")))] == 1
    assert found[("celery_redlock_reaped_total", (("reason", "pid_gone"), ("worker", "w1")))] == 2
    assert found[("celery_redlock_reaper_passes_total", (("worker", "w1"),))] == 3
    inf = (
        "celery_redlock_lock_wait_seconds_bucket",
        (("le", "+Inf"), ("task", "app.t"), ("worker", "w1")),
    )
    assert found[inf] == 2
    assert not any(labels and ("worker", "off") in labels for _, labels in found)

    alone = samples(exposition(families({None: report(5)}, by_worker=False)))
    assert alone[("celery_redlock_acquired_total", (("task", "app.t"),))] == 5


def test_ops_settings_defaults_and_errors_name_the_setting():
    """Defaults apply when unset; a bad value names the setting (or the option) that held it."""
    assert read_ops_settings({}) == OpsSettings()
    assert read_ops_settings({"redlock_metrics_port": 0}).metrics_port == 0
    assert read_ops_settings({"redlock_metrics_port": 1}, metrics_port="9808").metrics_port == 9808
    with pytest.raises(ConfigurationError, match="redlock_reaper_interval"):
        read_ops_settings({"redlock_reaper_interval": 0})
    with pytest.raises(ConfigurationError, match="redlock_reaper"):
        read_ops_settings({"redlock_reaper": "yes"})
    with pytest.raises(ConfigurationError, match="--redlock-metrics-port"):
        read_ops_settings({}, metrics_port=70000)
    with pytest.raises(ConfigurationError, match="redlock_metrics_port"):
        read_ops_settings({"redlock_metrics_port": True})
