"""enqueue_once(mode=...) with real ``rq worker`` processes: debounce, keep latest, period."""

from __future__ import annotations

import json
import time

import pytest
from rq import Queue
from rq.job import JobStatus

from celery_redlock import ConfigurationError
from celery_redlock.rq import SUPERSEDED_META, enqueue_once
from tests.rq_apps import windows_jobs
from tests.rq_harness import rq_workers, wait_until


def runs(client):
    return [json.loads(raw) for raw in client.lrange(windows_jobs.RUNS, 0, -1)]


@pytest.mark.timeout(60)
def test_debounce_runs_the_last_call_once(redis_server, tmp_path):
    """Ten calls within a second, debounce=1: one run with the last call's arguments."""
    client = redis_server.client()
    queue = Queue("debounce", connection=client)
    jobs = []
    for x in range(10):
        jobs.append(enqueue_once(queue, windows_jobs.newest, ("k", x), mode="debounce", debounce=1))
        time.sleep(0.05)
    last_call = time.time()
    with rq_workers(redis_server.url, queue.name, tmp_path, 1, scheduler=True):
        wait_until(
            lambda: all(job.get_status() == JobStatus.FINISHED for job in jobs),
            40,
            "every job to finish",
        )
    assert [run["x"] for run in runs(client)] == [9]
    assert runs(client)[0]["start"] >= last_call + 0.9
    assert jobs[-1].return_value() == 9
    for job in jobs[:-1]:
        job.refresh()
        assert job.return_value() == "SUPERSEDED" and job.meta[SUPERSEDED_META]["by"]


@pytest.mark.timeout(90)
def test_keep_latest_runs_rising_arguments_one_at_a_time(redis_server, tmp_path):
    """keep="latest": 20 rising calls while a slow job runs; runs rise, never overlap, last runs."""
    client = redis_server.client()
    queue = Queue("latest", connection=client)
    options = {"mode": "until_and_while_executing", "keep": "latest"}
    with rq_workers(redis_server.url, queue.name, tmp_path, 2, scheduler=True):
        enqueue_once(queue, windows_jobs.newest, ("k", 0, 1.0), **options)
        key = windows_jobs.newest.lock_key_for("k", 0)
        wait_until(lambda: client.exists(key), 30, "the first job to take its lock")
        jobs = [
            enqueue_once(queue, windows_jobs.newest, ("k", x, 0.2), **options) for x in range(1, 21)
        ]
        wait_until(lambda: jobs[-1].get_status() == JobStatus.FINISHED, 60, "the last job")
        wait_until(
            lambda: all(job.get_status() == JobStatus.FINISHED for job in jobs),
            30,
            "every job to finish",
        )
    recorded = runs(client)
    xs = [run["x"] for run in recorded]
    assert xs == sorted(set(xs)) and xs[0] == 0 and xs[-1] == 20, xs
    for before, after in zip(recorded, recorded[1:]):
        assert after["start"] >= before["end"], recorded


def test_until_expired_returns_the_accepted_job_for_the_period(redis_server):
    """period=1: identical calls get the accepted job, then a new one after the period."""
    client = redis_server.client()
    queue = Queue("period", connection=client)
    accepted = time.monotonic()
    first = enqueue_once(queue, windows_jobs.plain, ("k", 1), mode="until_expired", period=1)
    assert enqueue_once(queue, windows_jobs.plain, ("k", 1), mode="until_expired", period=1).id == (
        first.id
    )
    while (
        again := enqueue_once(queue, windows_jobs.plain, ("k", 1), mode="until_expired", period=1)
    ).id == first.id:
        time.sleep(0.05)
    assert time.monotonic() - accepted >= 1.0
    assert again.get_status() == JobStatus.QUEUED


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ({"mode": "debounce"}, "debounce"),
        ({"mode": "debounce", "debounce": 0}, "debounce"),
        ({"mode": "debounce", "debounce": 2, "debounce_max_wait": 1}, "debounce_max_wait"),
        ({"mode": "until_and_while_executing", "keep": "last"}, "keep"),
        ({"mode": "until_executed", "period": 2}, "period"),
        ({"mode": "while_executing"}, "mode"),
    ],
)
def test_bad_window_options_name_the_option(redis_server, options, setting):
    """Each bad option raises one ConfigurationError naming it; nothing is enqueued."""
    queue = Queue("bad", connection=redis_server.client())
    with pytest.raises(ConfigurationError) as info:
        enqueue_once(queue, windows_jobs.newest, ("k", 1), **options)
    assert info.value.setting == setting
    with pytest.raises(ConfigurationError) as info:
        enqueue_once(queue, windows_jobs.plain, ("k", 1), mode="debounce", debounce=1)
    assert info.value.setting == "mode"
    assert queue.count == 0


@pytest.mark.timeout(30)
def test_placement_options_reach_the_enqueue(redis_server):
    """at_front (enqueue_job's option, not create_job's) puts a keep-latest job first."""
    client = redis_server.client()
    queue = Queue("placed", connection=client)
    queue.enqueue(windows_jobs.plain, "other", 0)
    job = enqueue_once(
        queue,
        windows_jobs.newest,
        ("k", 1),
        mode="until_and_while_executing",
        keep="latest",
        at_front=True,
    )
    assert queue.job_ids[0] == job.id
