"""RQ storms across two real ``rq worker`` processes: skip runs once, requeue runs all serially."""

from __future__ import annotations

import pytest
from rq import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from celery_redlock.rq import REQUEUES_META, SKIP_META
from tests.hold_log import assert_serial
from tests.rq_apps import jobs
from tests.rq_harness import rq_workers, wait_for_jobs, wait_until


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_skip_storm_of_100_identical_jobs_runs_exactly_once(redis_server, tmp_path):
    """100 identical jobs, 2 burst workers, on_conflict=skip: one run, 99 skips, none lost."""
    client = redis_server.client()
    queue = Queue("storm-skip", connection=client)
    enqueued = [queue.enqueue(jobs.held_until_released, "same") for _ in range(100)]
    finished = FinishedJobRegistry(queue=queue)
    with rq_workers(redis_server.url, queue.name, tmp_path, 2, burst=True) as workers:
        # One job holds its lock until all others have been dealt with.
        wait_until(lambda: finished.count >= 99, 90, "99 skipped jobs")
        client.set(jobs.RELEASE, 1)
        wait_for_jobs(enqueued, 30, workers)
    assert int(client.get(jobs.RUNS)) == 1
    for job in enqueued:
        job.refresh()
    assert all(job.is_finished for job in enqueued)
    ran = [job for job in enqueued if job.return_value() == "ran same"]
    skipped = [job for job in enqueued if job.return_value() == "SKIPPED"]
    assert len(ran) == 1 and len(skipped) == 99
    assert all(job.meta[SKIP_META]["holder"] == ran[0].id for job in skipped)
    assert FailedJobRegistry(queue=queue).count == 0
    assert not client.exists(jobs.held_until_released.lock_key_for("same"))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_requeue_storm_of_100_identical_jobs_runs_all_serially(redis_server, tmp_path):
    """100 identical jobs, 2 workers with scheduler, on_conflict=requeue: 100 runs, no overlap."""
    client = redis_server.client()
    queue = Queue("storm-requeue", connection=client)
    enqueued = [queue.enqueue(jobs.serial, "same") for _ in range(100)]
    with rq_workers(redis_server.url, queue.name, tmp_path, 2, scheduler=True) as workers:
        try:
            wait_until(lambda: client.llen(jobs.LOG) >= 100, 150, "100 serial runs")
            wait_until(
                lambda: FinishedJobRegistry(queue=queue).count >= 100, 20, "100 finished jobs"
            )
        except AssertionError:
            raise AssertionError("\n".join(w.log() for w in workers)) from None
    assert_serial(client, jobs.LOG, 100)
    for job in enqueued:
        job.refresh()
    assert all(job.is_finished and job.return_value() == "same" for job in enqueued)
    assert FailedJobRegistry(queue=queue).count == 0
    # Contention really happened, and went through RQ's scheduling of the same job ids.
    assert sum(job.meta.get(REQUEUES_META, 0) for job in enqueued) > 0
