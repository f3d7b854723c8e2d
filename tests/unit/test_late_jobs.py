"""A failed background job read by a round keeps nothing of the thread that read it.

Redlock reads its masters' jobs on the caller's thread (``job_outcome``), or
on whichever thread ends them (``use_late_job``, which may run right where
its callback is added). An error raised again there would take that
thread's frames into its traceback, the Redlock's among them, in a cycle
through the job that holds the error: the lock and its connections would
then wait for the cyclic collector (see
``test_a_failed_redlock_is_freed_as_soon_as_it_is_dropped``, which caught
this only when a job ended before its round read it).
"""

from __future__ import annotations

import concurrent.futures
import gc
import weakref

import pytest
import redis

from celery_redlock.core.late_jobs import job_outcome, use_late_job
from celery_redlock.core.nodes import node_for
from celery_redlock.core.wire import Request


class _Caller:
    """Stands for the Redlock whose frame reads the job."""


def _read_failed_job(read):
    """Read a failed job as ``read(job)`` does, in a frame holding a caller; return the caller."""
    caller = _Caller()
    job: concurrent.futures.Future[object] = concurrent.futures.Future()
    job.set_exception(redis.ConnectionError("Connection refused"))
    read(job)
    return weakref.ref(caller)


@pytest.fixture
def node():
    # Never connected: nothing listens there, and nothing here connects.
    return node_for("redis://127.0.0.1:9/0", 0.5)


@pytest.mark.parametrize("reader", ["job_outcome", "use_late_job"])
def test_a_failed_job_read_keeps_no_frame_of_its_reader(node, reader):
    release = Request.release("job", b"token")
    read = {
        "job_outcome": lambda job: job_outcome(node, job),
        "use_late_job": lambda job: use_late_job(node, release, None, job),
    }[reader]
    gc.disable()
    try:
        caller = _read_failed_job(read)
        assert caller() is None, "the error kept the frame that read it"
    finally:
        gc.enable()


def test_a_failed_job_reads_as_its_error(node):
    job: concurrent.futures.Future[object] = concurrent.futures.Future()
    error = redis.ConnectionError("Connection refused")
    job.set_exception(error)
    assert job_outcome(node, job) is error
