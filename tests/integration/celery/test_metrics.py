"""Prometheus metrics of a real prefork worker, scraped from it and from the dashboard.

A storm of calls (distinct ones, and duplicates of one held call) runs on a
prefork worker with two pool processes. Its own endpoint
(``--redlock-metrics-port 0``, the port read from its log) and the
dashboard's ``/metrics`` are scraped while the storm runs, and each scrape
lies between the worker's own counters (``redlock_stats``) read just before
and just after it; once the storm is over both match those counters, and
the task results, exactly. Text is parsed with ``prometheus_client``'s parser.
"""

from __future__ import annotations

import re
import urllib.request
import uuid
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from celery_redlock.celery.stats import COUNTERS
from tests.celery_harness import CeleryWorker, History, task_states, wait_until
from tests.integration.celery.conftest import WorkerFactory
from tests.web_harness import DashboardProcess, listening_addresses

pytestmark = pytest.mark.timeout(150)

TASK = "storm.hold"


@pytest.fixture
def storm_env(storm_env: dict[str, str]) -> dict[str, str]:
    return {**storm_env, "REDLOCK_TEST_INSTALL": "1"}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample name and labels -> value, parsed by prometheus_client."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def own_counts(app: Celery, worker: CeleryWorker) -> dict[str, Any]:
    replies = app.control.broadcast(
        "redlock_stats", reply=True, timeout=3, destination=[worker.nodename]
    )
    merged: dict[str, Any] = {}
    for reply in replies:
        merged.update(reply)
    return merged[worker.nodename]


def counter(samples: dict, name: str, **labels: str) -> float:
    key = (f"celery_redlock_{name}_total", tuple(sorted({"task": TASK, **labels}.items())))
    return samples.get(key, 0.0)


def metrics_port(worker: CeleryWorker) -> int:
    found = wait_until(
        lambda: re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", worker.log()),
        timeout=10,
        message="the metrics endpoint's address in the log",
    )
    return int(found[1])


def test_metrics_match_the_workers_own_counters_during_and_after_a_storm(
    storm_env: dict[str, str],
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    history: History,
    prefix: str,
    tmp_path: Any,
) -> None:
    """Every scrape lies between the worker's counters before and after it; at rest, equal."""
    worker = worker_factory("prefork", 2, extra_args=["--redlock-metrics-port", "0"])
    port = metrics_port(worker)
    assert listening_addresses(port) == {"127.0.0.1"}
    own_url = f"http://127.0.0.1:{port}/metrics"
    task = storm_app.tasks[TASK]
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    held = task.delay("held", 0, gate)
    wait_until(lambda: db9.exists(task.lock_key_for("held", 0, gate)), timeout=20, message="held")
    calls, duplicates = [held.id], []
    dashboard = DashboardProcess("tests.celery_apps.storm", storm_env, [], tmp_path / "logs")
    with dashboard as web:
        for round_ in range(4):
            calls += [task.delay(f"{round_}-{x}", 0.02).id for x in range(15)]
            duplicates += [task.delay("held", 0, gate).id for _ in range(5)]
            for url, labels in ((own_url, {}), (f"{web.url}/metrics", {"worker": worker.nodename})):
                before = own_counts(storm_app, worker)["tasks"].get(TASK, {})
                scraped = scrape(url)
                after = own_counts(storm_app, worker)["tasks"].get(TASK, {})
                for name in COUNTERS:
                    value = counter(scraped, name, **labels)
                    assert before.get(name, 0) <= value <= after.get(name, 0), (url, name)
        # Every duplicate meets the held lock before the gate opens: 20 skips, exactly.
        wait_until(
            lambda: all(s == "SKIPPED" for s, _ in task_states(storm_app, duplicates).values()),
            timeout=60,
            message="the duplicates skipped",
        )
        calls += duplicates
        db9.set(gate, 1)
        wait_until(
            lambda: all(
                state in ("SUCCESS", "SKIPPED")
                for state, _ in task_states(storm_app, calls).values()
            ),
            timeout=60,
            message="the storm's calls done",
        )
        states = [state for state, _ in task_states(storm_app, calls).values()]
        final = own_counts(storm_app, worker)
        own, via_dashboard = scrape(own_url), scrape(f"{web.url}/metrics")

    totals = final["tasks"][TASK]
    assert totals["acquired"] == states.count("SUCCESS") == totals["released"]
    assert totals["skipped"] == states.count("SKIPPED") == 20
    # Counted in both pool processes, summed: every recorded execution is one acquisition.
    executions = history.executions()
    assert len({execution.pid for execution in executions}) == 2
    assert len(executions) == totals["acquired"]
    for name in COUNTERS:
        assert counter(own, name) == totals[name], name
        assert counter(via_dashboard, name, worker=worker.nodename) == totals[name], name
    count = ("celery_redlock_lock_wait_seconds_count", (("task", TASK),))
    assert own[count] == totals["acquired"]
    assert own[("celery_redlock_held_locks", (("task", TASK),))] == 0
    inf = ("celery_redlock_lock_wait_seconds_bucket", (("le", "+Inf"), ("task", TASK)))
    assert own[inf] == totals["acquired"]
    assert via_dashboard[("celery_redlock_dashboard_up", (("source", "store"),))] == 1
