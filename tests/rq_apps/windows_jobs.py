"""Job functions of the RQ window tests (tests/integration/rq/test_rq_windows.py)."""

from __future__ import annotations

import json
import time

from rq import get_current_job

from celery_redlock.rq import singleton_job

#: List of ``{"x", "start", "end"}`` records, one per run.
RUNS = "windows:runs"


@singleton_job(
    key=["k"], on_conflict="requeue", requeue_delay=1, requeue_max_delay=1, skipped="SUPERSEDED"
)
def newest(k, x, seconds=0):
    """Record a run of argument ``x`` lasting ``seconds``."""
    job = get_current_job()
    assert job is not None
    start = time.time()
    time.sleep(seconds)
    job.connection.rpush(RUNS, json.dumps({"x": x, "start": start, "end": time.time()}))
    return x


def plain(k, x):
    """Not a singleton_job: cannot retire superseded jobs."""
    return x
