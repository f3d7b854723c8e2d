"""Twenty forked processes fight over one Redlock on five masters."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import redis

from celery_redlock import Redlock

FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"
PROCESSES = 20
HOLDS = 5


def contender(urls, witness_url, index, queue):
    """Take the lock HOLDS times; inside, do a read-modify-write that overlap would break."""
    lock = Redlock(urls, "contended", timeout=5, sleep=0.02, blocking_timeout=90)
    witness = redis.Redis.from_url(witness_url)
    records = []
    try:
        for _ in range(HOLDS):
            if not lock.acquire():
                queue.put((index, "timed out", records))
                return
            start = time.monotonic()
            fence = lock.fence
            value = int(witness.get("counter") or 0)
            time.sleep(0.002)
            witness.set("counter", value + 1)
            end = time.monotonic()
            lock.release()
            records.append((start, end, fence))
    except Exception as exc:  # reported to the parent, which fails the test
        queue.put((index, repr(exc), records))
        return
    queue.put((index, "ok", records))


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings(FORK_WARNING)
def test_twenty_processes_never_overlap_and_fences_follow_hold_order(redis_servers):
    """20 forked contenders: no holds overlap, all get their turns, fences rise in hold order."""
    masters = redis_servers(5)
    (witness_server,) = redis_servers(1)
    urls = [s.url for s in masters]
    # The parent uses the masters first, so children start with inherited
    # connections that they must not touch (reset after fork).
    parent_lock = Redlock(urls, "contended", timeout=5)
    assert parent_lock.acquire(blocking=False)
    parent_lock.release()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=contender, args=(urls, witness_server.url, i, queue))
        for i in range(PROCESSES)
    ]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=150) for _ in procs]
    for proc in procs:
        proc.join(timeout=10)
    elapsed = time.monotonic() - started
    failures = [(index, status) for index, status, _ in results if status != "ok"]
    assert not failures
    holds = sorted(record for _, _, records in results for record in records)
    assert len(holds) == PROCESSES * HOLDS
    overlaps = [(a, b) for a, b in zip(holds, holds[1:]) if b[0] < a[1]]
    assert not overlaps
    assert int(witness_server.client().get("counter")) == PROCESSES * HOLDS
    fences = [fence for _, _, fence in holds]
    assert all(a < b for a, b in zip(fences, fences[1:]))
    assert parent_lock.acquire(blocking=False)
    assert parent_lock.fence > fences[-1]
    parent_lock.release()
    print(f"\n{len(holds)} holds by {PROCESSES} processes in {elapsed:.1f} s")
