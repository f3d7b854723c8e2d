"""Debounce, keep-the-newest and once-per-period windows against real workers.

The tasks are in ``tests.celery_apps.windows``; each run records its
arguments when it starts and ends, so the tests check which call ran, how
often, and that no two runs of a key overlapped.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
import redis
from celery import Celery

from celery_redlock import SUPERSEDED
from tests.celery_apps import windows
from tests.celery_harness import wait_until

if TYPE_CHECKING:
    from tests.integration.celery.conftest import WorkerFactory


def never_overlap(db9: redis.Redis, prefix: str) -> None:
    """No run of the window tasks started before the previous one ended."""
    records = [r for r in windows.runs(db9, prefix, "start") + windows.runs(db9, prefix, "end")]
    records.sort(key=lambda r: r["time"])
    running = 0
    for record in records:
        running += 1 if record["phase"] == "start" else -1
        assert running <= 1, records


@pytest.mark.timeout(60)
@pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)
def test_debounce_burst_runs_once_with_the_last_arguments(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """50 calls within 2 s, lock_debounce=1: one run, the 50th call's arguments, after the last.

    Every result resolves to that run's value; the 49 others are SUPERSEDED.
    """
    worker_factory("threads", 4)
    task = storm_app.tasks["windows.debounce"]
    results = []
    for x in range(50):
        results.append(task.delay("k", x))
        time.sleep(0.04)
    last_call = time.time()
    assert len({r.id for r in results}) == 50
    assert [r.get(timeout=20) for r in results] == [49] * 50
    (run,) = windows.runs(db9, prefix)
    assert run["x"] == 49 and run["task_id"] == results[-1].id
    assert run["time"] >= last_call + 0.9  # the quiet second after the last call
    superseded = [r for r in results[:-1] if r.state == SUPERSEDED]
    wait_until(
        lambda: all(r.state == SUPERSEDED for r in results[:-1]),
        timeout=10,
        message="every older copy retired",
    )
    assert len(windows.runs(db9, prefix)) == 1, superseded


@pytest.mark.timeout(60)
def test_debounce_max_wait_runs_every_period_with_the_newest_arguments(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """Calls every 0.2 s for 5 s, max_wait=1.5: a run every 1.5 s while calls keep coming.

    Without max_wait nothing would run before the calls stop; with it, runs
    happen during the burst, 1.5 s apart (the one after the last call, 1 s
    of quiet after it). A run's arguments are at least those of every call
    that returned 0.5 s before it started (the claim precedes the body by
    less than that); runs strictly increase, the last call runs, and every
    result resolves.
    """
    worker_factory("threads", 4)
    task = storm_app.tasks["windows.debounce_max"]
    calls = []
    for x in range(25):
        calls.append((task.delay("k", x), time.time()))
        time.sleep(0.2)
    assert calls[-1][0].get(timeout=20) == 24
    started = windows.runs(db9, prefix)
    xs = [run["x"] for run in started]
    assert xs == sorted(set(xs)) and xs[-1] == 24 and len(xs) >= 3, xs
    during = [run for run in started if run["time"] < calls[-1][1]]
    assert len(during) >= 2, started
    # Lower bounds, with room for the pool picking a due run up late: 1.5 s
    # between claims during the calls, the 1 s quiet time after the last one.
    for before, after in zip(during, during[1:]):
        assert after["time"] - before["time"] >= 1.25, started
    assert started[-1]["time"] - started[-2]["time"] >= 0.75, started
    for run in started:
        returned = [x for x, (_, at) in enumerate(calls) if at < run["time"] - 0.5]
        assert not returned or run["x"] >= max(returned), (run, returned)
    for x, (result, _) in enumerate(calls):
        assert result.get(timeout=20) >= x


@pytest.mark.timeout(90)
def test_keep_latest_storm_runs_rising_arguments_one_at_a_time(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """keep="latest": 200 rising calls while a slow copy runs; 1 running, newest waiting.

    Runs never overlap, their arguments strictly increase, the last call
    runs, and every call's result resolves to a run of at least its arguments.
    """
    worker_factory("threads", 4)
    task = storm_app.tasks["windows.latest"]
    first = task.delay("k", 0, 0.5)
    wait_until(lambda: windows.runs(db9, prefix), timeout=20, message="the first run")
    results = [task.delay("k", x, 0.2) for x in range(1, 200)]
    assert results[-1].get(timeout=30) == 199
    assert first.get(timeout=10) == 0
    xs = [run["x"] for run in windows.runs(db9, prefix)]
    assert xs == sorted(set(xs)) and xs[-1] == 199, xs
    assert len(xs) < 20, xs  # superseded copies never ran
    never_overlap(db9, prefix)
    for x, result in enumerate(results, start=1):
        assert result.get(timeout=20) >= x


@pytest.mark.timeout(60)
def test_until_expired_refuses_duplicates_for_the_period(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """lock_period=2: duplicates get the accepted call, also after it finished, until 2 s passed."""
    worker_factory("solo")
    task = storm_app.tasks["windows.expired"]
    accepted_at = time.time()
    first = task.delay("k", 1)
    assert task.delay("k", 2).id == first.id
    assert first.get(timeout=20) == 1
    assert task.delay("k", 3).id == first.id  # finished, still within its period
    second = wait_until(
        lambda: (r := task.delay("k", 4)).id != first.id and r, timeout=10, message="a new call"
    )
    assert time.time() - accepted_at >= 2.0
    assert second.get(timeout=20) == 4
    assert [run["x"] for run in windows.runs(db9, prefix)] == [1, 4]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("acks_late", [True])
def test_debounced_run_killed_runs_once_with_the_newest_arguments(
    storm_app: Celery, worker_factory: WorkerFactory, db9: redis.Redis, prefix: str
) -> None:
    """SIGKILL of the pool child running a debounced call (acks_late): it runs once, newest args."""
    worker_factory("prefork", 2)
    db9.set(f"{prefix}:{windows.KILL_FLAG}", 1)
    task = storm_app.tasks["windows.mortal"]
    results = [task.delay("k", x) for x in range(3)]
    assert [r.get(timeout=60) for r in results] == [2, 2, 2]
    assert [run["x"] for run in windows.runs(db9, prefix, "end")] == [2]
    assert [run["x"] for run in windows.runs(db9, prefix)] == [2, 2]  # killed, then the rerun
