"""singleton_job(limit=N) with real ``rq worker`` processes: N runs per key at once, the rest
requeued through RQ's own scheduling."""

from __future__ import annotations

import pytest
from rq import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from tests.rq_apps import jobs
from tests.rq_harness import rq_workers, wait_until


@pytest.mark.timeout(120)
def test_three_workers_run_two_jobs_of_a_key_at_once_and_requeue_the_rest(redis_server, tmp_path):
    """Eight identical jobs, three workers, limit 2: all run, never more than two at once,
    each in slot 0 or 1, with distinct fences; none fails (a refused one is requeued)."""
    client = redis_server.client()
    queue = Queue("limited", connection=client)
    enqueued = [queue.enqueue(jobs.limited, "same") for _ in range(8)]
    with rq_workers(redis_server.url, queue.name, tmp_path, 3, scheduler=True) as workers:
        try:
            wait_until(lambda: FinishedJobRegistry(queue=queue).count >= 8, 100, "8 runs")
        except AssertionError:
            raise AssertionError("\n".join(w.log() for w in workers)) from None
    entries = [entry.decode().split(":") for entry in client.lrange(jobs.LIMITED_LOG, 0, -1)]
    assert len(entries) == 8
    assert max(int(holders) for _, _, holders, _, _ in entries) <= 2
    assert {int(slot) for *_, slot in entries} <= {0, 1}
    assert len({fence for *_, fence, _ in entries}) == 8
    assert FailedJobRegistry(queue=queue).count == 0
    for job in enqueued:
        job.refresh()
    assert all(job.return_value() == "same" for job in enqueued)
