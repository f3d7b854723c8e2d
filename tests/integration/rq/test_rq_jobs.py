"""The RQ job lock and enqueue_once() with real ``rq worker`` processes."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import rq
from rq import Queue
from rq.job import JobStatus
from rq.registry import FailedJobRegistry

from celery_redlock import ConfigurationError
from celery_redlock.rq import REQUEUES_META, SKIP_META, enqueue_once, singleton_job
from tests.rq_apps import jobs
from tests.rq_harness import rq_workers, wait_for_jobs, wait_until


@pytest.mark.timeout(90)
def test_raise_fails_the_duplicate_naming_the_holder(redis_server, tmp_path):
    """Under on_conflict=raise a duplicate job fails with LockNotAcquired naming the holder."""
    client = redis_server.client()
    queue = Queue("raise", connection=client)
    first = queue.enqueue(jobs.held_or_fail, "x")
    with rq_workers(redis_server.url, queue.name, tmp_path, 2):
        wait_until(lambda: client.get(jobs.RUNS) == b"1", 30, "the first job to run")
        second = queue.enqueue(jobs.held_or_fail, "x")
        wait_until(lambda: second.get_status() == JobStatus.FAILED, 30, "the duplicate to fail")
        client.set(jobs.RELEASE, 1)
        wait_until(lambda: first.get_status() == JobStatus.FINISHED, 30, "the first job to end")
    assert FailedJobRegistry(queue=queue).get_job_ids() == [second.id]
    failure = second.latest_result().exc_string
    assert "LockNotAcquired" in failure and first.id in failure
    assert int(client.get(jobs.RUNS)) == 1


@pytest.mark.timeout(90)
def test_enqueue_once_returns_the_queued_or_running_job(redis_server, tmp_path):
    """An identical call returns the queued job, then the running one; a finished one does not."""
    client = redis_server.client()
    queue = Queue("once", connection=client)
    first = enqueue_once(queue, jobs.held_until_released, ("x",))
    assert enqueue_once(queue, jobs.held_until_released, ("x",)).id == first.id
    assert enqueue_once(queue, jobs.held_until_released, (), {"item": "x"}).id == first.id
    other = enqueue_once(queue, jobs.held_until_released, ("y",))
    assert other.id != first.id
    with rq_workers(redis_server.url, queue.name, tmp_path, 1, burst=True) as workers:
        wait_until(lambda: first.get_status() == JobStatus.STARTED, 30, "the job to start")
        assert enqueue_once(queue, jobs.held_until_released, ("x",)).id == first.id
        client.set(jobs.RELEASE, 1)
        wait_for_jobs([first, other], 30, workers)
    assert first.get_status() == JobStatus.FINISHED
    again = enqueue_once(queue, jobs.held_until_released, ("x",))
    assert again.id not in (first.id, other.id)
    assert again.get_status() == JobStatus.QUEUED


def test_concurrent_enqueue_once_makes_one_job(redis_server):
    """20 threads enqueueing the same call at once get one job between them."""
    client = redis_server.client()
    queue = Queue("once-race", connection=client)
    barrier = threading.Barrier(20)
    ids = []

    def enqueue():
        barrier.wait(10)
        ids.append(enqueue_once(queue, jobs.serial, ("same",)).id)

    threads = [threading.Thread(target=enqueue) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(ids) == 20 and len(set(ids)) == 1
    assert queue.count == 1


@pytest.mark.skipif(not hasattr(rq, "RateLimit"), reason="RQ's own rate limits came in RQ 3.0")
def test_enqueue_once_returns_a_job_rqs_rate_limit_holds_back(redis_server):
    """A job RQ 3 holds back under its own rate_limit (status rate_limited) is still returned."""
    client = redis_server.client()
    queue = Queue("once-rq-rate", connection=client)
    limit = rq.RateLimit("account", concurrency=1)
    running = enqueue_once(queue, print, ("a",), rate_limit=limit)
    held_back = enqueue_once(queue, print, ("b",), rate_limit=limit)
    assert running.get_status() == JobStatus.QUEUED
    assert held_back.get_status() == "rate_limited"
    assert enqueue_once(queue, print, ("b",), rate_limit=limit).id == held_back.id
    assert queue.count == 1


def test_enqueue_once_of_a_plain_function_keys_all_arguments(redis_server):
    """A function without singleton_job is deduplicated on all its arguments."""
    client = redis_server.client()
    queue = Queue("once-plain", connection=client)
    a = enqueue_once(queue, print, ("a",))
    assert enqueue_once(queue, print, ("a",)).id == a.id
    assert enqueue_once(queue, print, ("b",)).id != a.id
    with pytest.raises(ConfigurationError):
        enqueue_once(queue, print, ("a",), job_id="fixed")


def test_direct_call_outside_a_worker_runs_unlocked():
    """Called directly (no current job, no client), the function simply runs."""

    @singleton_job
    def add(a, b):
        return a + b

    assert add(1, 2) == 3


def test_bad_options_are_named():
    """Invalid options fail at decoration with ConfigurationError naming them."""
    with pytest.raises(ConfigurationError) as info:
        singleton_job(print, on_conflict="wait")
    assert info.value.setting == "on_conflict"
    with pytest.raises(ConfigurationError) as info:
        singleton_job(print, max_requeues=-1)
    assert info.value.setting == "max_requeues"


@pytest.mark.timeout(90)
def test_requeues_run_out_on_a_lock_store_that_stays_down_naming_the_outage(
    redis_server, redis_servers, tmp_path
):
    """A job whose lock store stays down fails naming the outage, not "held by another holder"."""
    (down,) = redis_servers(1)
    client = redis_server.client()
    queue = Queue("outage", connection=client)
    job = queue.enqueue(jobs.locked_elsewhere)
    env = {jobs.LOCK_STORE_ENV: down.url}
    down.pause()
    try:
        with rq_workers(redis_server.url, queue.name, tmp_path, 1, burst=True, env=env) as workers:
            wait_for_jobs([job], 60, workers)
    finally:
        down.resume()
    assert job.get_status() == JobStatus.FAILED, workers[0].log()
    message = job.latest_result().exc_string
    assert "LockNotAcquired" in message
    assert "gave up after 0 requeues" in message and "kept failing" in message
    assert "held by" not in message
    assert client.get(jobs.RUNS) is None  # the body never ran without its lock


@pytest.mark.timeout(90)
def test_a_failing_job_releases_its_lock(redis_server, tmp_path):
    """A job that raises releases its lock when it fails, so the same call runs next time."""
    client = redis_server.client()
    queue = Queue("fails", connection=client)
    key = jobs.fails_first.lock_key_for("x")
    first = queue.enqueue(jobs.fails_first, "x")
    with rq_workers(redis_server.url, queue.name, tmp_path, 1, burst=True) as workers:
        wait_for_jobs([first], 60, workers)
    assert first.get_status() == JobStatus.FAILED, workers[0].log()
    assert "ValueError: the first run of x fails" in first.latest_result().exc_string
    # The TTL is 60 s: only a release can have removed the key.
    assert not client.exists(key)
    second = queue.enqueue(jobs.fails_first, "x")
    with rq_workers(redis_server.url, queue.name, tmp_path / "again", 1, burst=True) as workers:
        wait_for_jobs([second], 60, workers)
    assert second.get_status() == JobStatus.FINISHED, workers[0].log()
    assert second.return_value() == "ran x"
    assert int(client.get(jobs.RUNS)) == 2
    assert not client.exists(key)


@pytest.mark.timeout(90)
def test_a_rerun_meeting_its_own_dead_runs_lock_waits_instead_of_skipping(redis_server, tmp_path):
    """A job requeued after its work-horse died meets its own lock: it waits, never skips.

    Under on_conflict="skip" a duplicate is dropped; the job's own earlier run is
    no duplicate. Skipping it would lose the job for good, its only run having died.
    """
    client = redis_server.client()
    queue = Queue("rerun", connection=client)
    key = jobs.dies_holding.lock_key_for("x")
    job = queue.enqueue(jobs.dies_holding, "x")
    with rq_workers(redis_server.url, queue.name, tmp_path, 1, scheduler=True) as (worker,):
        wait_until(lambda: client.exists(jobs.PID), 30, "the first run to start")
        os.kill(int(client.get(jobs.PID)), signal.SIGKILL)  # the work-horse, not the worker
        wait_until(lambda: job.get_status() == JobStatus.FAILED, 30, "the run to be failed")
        assert client.exists(key)  # the dead run's lock (TTL 60 s) is still there
        job.requeue()
        wait_until(
            lambda: REQUEUES_META in job.get_meta() or job.get_status() == JobStatus.FINISHED,
            30,
            "the rerun to meet the lock",
        )
        assert job.get_meta().get(SKIP_META) is None, worker.log()
        assert job.get_status() != JobStatus.FINISHED, worker.log()
        client.delete(key)  # as if the dead run's lock expired now
        wait_until(lambda: job.get_status() == JobStatus.FINISHED, 60, "the rerun to run")
    assert job.return_value() == "ran x"
    assert int(client.get(jobs.RUNS)) == 2
    assert not client.exists(key)
