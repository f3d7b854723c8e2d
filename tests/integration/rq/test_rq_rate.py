"""singleton_job(rate=...) with real ``rq worker`` processes: runs over the rate are
rescheduled through RQ's own scheduling to when a slot frees, never counted as requeues."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from rq import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from celery_redlock import ConfigurationError
from celery_redlock.rq import REQUEUES_META, SKIP_META, singleton_job
from tests.rq_apps import jobs
from tests.rq_harness import rq_workers, wait_for_jobs, wait_until


def _utc(moment: datetime) -> datetime:
    """``moment`` as an aware UTC time (RQ stores UTC, naive in some versions)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def most_in_a_window(starts: list[int], window_ms: int) -> int:
    """The most starts any half-open interval of ``window_ms`` holds."""
    ordered = sorted(starts)
    return max(
        sum(1 for s in ordered[i:] if s < start + window_ms) for i, start in enumerate(ordered)
    )


@pytest.mark.timeout(120)
def test_runs_over_the_rate_are_rescheduled_by_rq_until_a_slot_frees(redis_server, tmp_path):
    """Six jobs on one rate key of 2 per 2 s, two workers: all run, no 2 s window holds more
    than 2 starts, the refused ones went through RQ's scheduled registry (a Retry), and no
    rate refusal was counted as a lock requeue."""
    client = redis_server.client()
    queue = Queue("rated", connection=client)
    enqueued = [queue.enqueue(jobs.rated, i) for i in range(6)]
    with rq_workers(redis_server.url, queue.name, tmp_path, 2, scheduler=True) as workers:
        try:
            wait_until(lambda: FinishedJobRegistry(queue=queue).count >= 6, 100, "6 runs")
        except AssertionError:
            raise AssertionError("\n".join(w.log() for w in workers)) from None
    entries = [entry.decode().split(":") for entry in client.lrange(jobs.RATED_LOG, 0, -1)]
    admitted = {int(item): int(at) for item, at in entries}
    starts = [int(at) for _, at in entries]
    assert len(starts) == 6
    assert most_in_a_window(starts, 2000) <= 2
    assert FailedJobRegistry(queue=queue).count == 0
    for job in enqueued:
        job.refresh()
    assert sorted(job.return_value() for job in enqueued) == list(range(6))
    # At most two of six start in the first window, so four or more were refused first. Each
    # job's last start by a worker is its admitted run: a refused run returned at once and RQ
    # started the same job again when its slot was due (it did not wait inside the worker).
    # RQ's own retry counter is no evidence: RQ 2.3 does not count a Retry with an interval.
    for job in enqueued:
        started_ms = _utc(job.started_at).timestamp() * 1000
        assert abs(admitted[job.return_value()] - started_ms) < 1500, job.id
    assert all(REQUEUES_META not in job.meta for job in enqueued)


@pytest.mark.timeout(60)
def test_skip_over_the_rate_finishes_the_job_with_skipped_and_says_why(redis_server, tmp_path):
    """Rate 1/m under skip: one of two jobs runs, the other finishes SKIPPED, meta saying rate."""
    client = redis_server.client()
    queue = Queue("rated_skip", connection=client)
    first = queue.enqueue(jobs.rated_or_skipped, 1)
    second = queue.enqueue(jobs.rated_or_skipped, 2)
    with rq_workers(redis_server.url, queue.name, tmp_path, 1, burst=True) as workers:
        wait_for_jobs([first, second], 45, workers)
    first.refresh()
    second.refresh()
    assert (first.return_value(), second.return_value()) == (1, "SKIPPED")
    assert second.meta[SKIP_META]["reason"] == "rate"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"rate": "fast"}, "rate"),
        ({"rate": "0/s"}, "rate"),
        ({"rate": "10/s", "rate_key": "missing"}, "rate_key"),
    ],
)
def test_bad_rate_options_fail_at_decoration_naming_the_option(options, named):
    """A bad rate or rate key is a ConfigurationError naming the option, before any job runs."""

    def job(account):
        return account

    with pytest.raises(ConfigurationError) as bad:
        singleton_job(job, **options)
    assert bad.value.setting.split(".")[-1] == named
