"""Redlock's masters reached through a client (RESP3 here): requests never sent, full job slots.

A master reached through its client runs each request in a job on the
thread pool, at most ``MAX_JOBS`` at once. These tests pause a master
(``SIGSTOP``) so that its jobs hang, and check what is sent once it resumes.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import redis

from celery_redlock import Redlock
from celery_redlock.core.job_slots import MAX_WAITING
from celery_redlock.core.nodes import MAX_JOBS, node_for
from celery_redlock.core.wire import Request
from tests.integration.test_redlock import wait_until, warm


def take_every_job_slot(node):
    """Start requests for other keys on ``node`` until every job slot is taken."""
    return [node.start(Request(("SET", f"other{i}", "x"))) for i in range(MAX_JOBS)]


def refused_by_two_with_the_third_paused(redis_servers, node_timeout):
    """A Redlock over 3 masters, the third through its client (RESP3) and paused.

    The first two hold the key for someone else, so an acquire is refused
    there at once; the third's command counts start from zero. The caller
    resumes the third master.
    """
    first, second, third = redis_servers(3)
    masters = [first.client(), second.client(), third.client(protocol=3)]
    lock = Redlock(masters, "job", timeout=30, node_timeout=node_timeout, fencing=False)
    for refusing in (first, second):
        refusing.client().set("job", "someone else", px=60_000)
    third.reset_stats()
    third.pause()
    return third, lock


def jobs_of(lock, i):
    """How many background jobs master ``i`` of ``lock`` has running or queued on the pool."""
    return lock._masters.nodes[i].jobs.running


@pytest.mark.timeout(60)
def test_the_undo_of_an_acquire_never_sent_through_a_client_is_not_sent(redis_servers):
    """An acquire whose new connection could not even open was never written: nothing to undo.

    The third master is paused before Redlock has any connection to it, so
    the acquire's job times out in the connection's handshake (``HELLO``),
    before the acquire is written. Its undo used to be tried again for a few
    node timeouts, and sent once the master resumed.
    """
    third, lock = refused_by_two_with_the_third_paused(redis_servers, node_timeout=0.5)
    try:
        # Refused by two masters at once: the third's acquire is still on its way.
        assert not lock.acquire(blocking=False)
        # The acquire's handshake times out (0.5 s); its undo, if tried,
        # would be tried for a few node timeouts more.
        time.sleep(1.2)
    finally:
        third.resume()
    assert wait_until(lambda: jobs_of(lock, 2) == 0, timeout=10)
    stats = third.commandstats()
    assert stats.get("set", 0) == 0, stats  # the acquire never reached the master
    assert stats.get("eval", 0) == 0, stats  # nor should an undo


@pytest.mark.timeout(60)
def test_the_undo_of_an_acquire_refused_a_job_slot_through_a_client_is_not_sent(redis_servers):
    """An acquire refused a job slot was never sent: its undo neither runs nor waits for a slot."""
    third, lock = refused_by_two_with_the_third_paused(redis_servers, node_timeout=1.0)
    try:
        take_every_job_slot(lock._masters.nodes[2])
        assert not lock.acquire(blocking=False)
    finally:
        third.resume()
    assert wait_until(lambda: jobs_of(lock, 2) == 0, timeout=10)
    stats = third.commandstats()
    assert stats.get("set", 0) == MAX_JOBS, stats  # the other keys', not the acquire
    assert stats.get("eval", 0) == 0, stats


@pytest.mark.timeout(60)
def test_a_release_through_a_client_waits_for_a_job_slot(redis_servers):
    """A release to a master whose job slots are all taken waits for one, and frees the key.

    It used to be refused at once, leaving the key on that master until its TTL.
    """
    first, second, third = redis_servers(3)
    masters = [first.client(), second.client(), third.client(protocol=3)]
    lock = Redlock(masters, "job", timeout=30, node_timeout=1.0, fencing=False)
    warm(lock)  # every master gets every request from now on
    assert lock.acquire(blocking=False), lock.local.failure
    assert first.client().get("job") == second.client().get("job") == lock.token
    check = third.client()
    assert wait_until(lambda: check.get("job") == lock.token and jobs_of(lock, 2) == 0, timeout=5)
    node = lock._masters.nodes[2]
    third.pause()
    try:
        take_every_job_slot(node)
        with pytest.raises(redis.ConnectionError):  # anything but a release: refused at once
            node.start(Request(("SET", "another", "x")))
        lock.release()  # won on the other two masters
    finally:
        third.resume()  # before the jobs taking the slots time out
    assert wait_until(lambda: check.get("job") is None, timeout=5), check.get("job")


@pytest.mark.timeout(60)
def test_releases_waiting_for_a_hung_masters_job_slots_are_bounded_and_all_end(redis_servers):
    """A master that never answers: at most MAX_WAITING releases wait, and every one ends.

    Each job ends at its socket timeouts, so the slots free up and the
    waiting releases run (and fail) in turn; one more is refused at once.
    """
    (server,) = redis_servers(1)
    node = node_for(server.client(protocol=3), 0.2)
    server.pause()
    try:
        jobs = take_every_job_slot(node)
        jobs += [node.start(Request.release(f"job{i}", b"token")) for i in range(MAX_WAITING)]
        with pytest.raises(redis.ConnectionError):
            node.start(Request.release("one-more", b"token"))
        done, left = concurrent.futures.wait(jobs, timeout=30)
        assert not left
        assert all(job.exception() is not None for job in done)
        assert wait_until(lambda: node.jobs.running == 0)
    finally:
        server.resume()
