"""A master's job slots once their thread pool takes no more jobs (as at interpreter exit).

No Redis here: the jobs are plain functions on a real thread pool, which is
shut down while releases wait for a slot, as Python's exit does to every
pool before joining its threads.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from celery_redlock.core.job_slots import JobSlots
from celery_redlock.core.through_client import NotSent
from celery_redlock.core.wire import Request


@pytest.mark.timeout(60)
def test_releases_waiting_when_the_pool_stops_taking_jobs_fail_as_never_sent():
    """Each waiting release ends, failed as never sent; none is dropped unanswered.

    They used to stay pending for ever (the callback handing a freed slot on
    failed, logging ``exception calling callback`` once per release), and a
    new request raised the pool's ``RuntimeError``.
    """
    pool = concurrent.futures.ThreadPoolExecutor(1)
    slots = JobSlots(1)
    gate = threading.Event()

    def run(request, previous):
        gate.wait(30)
        return request

    try:
        taking_the_slot = slots.start(pool, run, Request(("SET", "other", "x")), "other")
        waiting = [
            slots.start(pool, run, Request.release(f"job{i}", b"token"), f"job{i}")
            for i in range(3)
        ]
        assert slots.running == 1
        pool.shutdown(wait=False)
    finally:
        gate.set()
    assert taking_the_slot.result(timeout=30) is not None
    _, left = concurrent.futures.wait(waiting, timeout=10)
    assert not left, "a waiting release was never run nor failed"
    assert all(isinstance(job.exception(), NotSent) for job in waiting)
    assert slots.running == 0
    with pytest.raises(NotSent):
        slots.start(pool, run, Request.release("one-more", b"token"), "one-more")
