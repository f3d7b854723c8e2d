"""Mutual exclusion and fence ordering under real contention: processes and threads."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from celery_redlock import Lock, LockNotAcquired
from tests.hold_log import assert_serial_holds, run_contenders

FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"


def hold_repeatedly(url: str, rounds: int, hold: float, results) -> None:
    """Take the lock ``rounds`` times; inside each hold, prove nobody else holds it."""
    client = redis.Redis.from_url(url)
    intervals = []
    try:
        for _ in range(rounds):
            lock = Lock(client, "exclusive", timeout=5, sleep=0.002, blocking_timeout=60)
            assert lock.acquire()
            start = time.monotonic()
            holders = client.incr("holders")
            client.rpush("fences", lock.fence)
            time.sleep(hold)
            client.decr("holders")
            end = time.monotonic()
            lock.release()
            intervals.append((start, end, holders, lock.lease.fence))
        results.put(("ok", intervals))
    except BaseException as exc:  # report, so the parent fails with the cause
        results.put(("error", repr(exc)))


@pytest.mark.filterwarnings(FORK_WARNING)
@pytest.mark.timeout(120)
def test_fifty_processes_exclude_each_other_and_fences_follow_hold_order(redis_server):
    """50 forked contenders: hold intervals never overlap, fences rise in hold order."""
    intervals = run_contenders(hold_repeatedly, 50, redis_server.url, 4, 0.002)
    assert_serial_holds(intervals, 200)
    client = redis_server.client()
    fences = [int(f) for f in client.lrange("fences", 0, -1)]
    assert len(fences) == 200
    assert all(a < b for a, b in zip(fences, fences[1:])), "fences not increasing in hold order"
    by_start = [fence for *_, fence in sorted(intervals)]
    assert by_start == fences


@pytest.mark.parametrize("decode_responses", [False, True])
def test_threads_sharing_one_client_pool_exclude_each_other(redis_server, decode_responses):
    """16 threads on one client (one connection pool) never hold the lock together."""
    client = redis_server.client(decode_responses=decode_responses)
    intervals: list = []
    failures: list = []
    guard = threading.Lock()

    def worker() -> None:
        try:
            for _ in range(15):
                lock = Lock(client, "shared", timeout=5, sleep=0.001, blocking_timeout=30)
                assert lock.acquire()
                start = time.monotonic()
                holders = client.incr("holders")
                time.sleep(0.001)
                client.decr("holders")
                end = time.monotonic()
                lock.release()
                with guard:
                    intervals.append((start, end, holders, lock.lease.fence))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures
    assert_serial_holds(intervals, 16 * 15)


def test_one_thread_local_lock_instance_shared_by_threads(redis_server):
    """A single Lock object used from many threads keeps each thread's hold separate."""
    client = redis_server.client()
    lock = Lock(client, "instance", timeout=5, sleep=0.001, blocking_timeout=30)
    overlaps = []
    count = [0]

    def worker() -> None:
        for _ in range(20):
            with lock:
                count[0] += 1
                if client.incr("holders") != 1:
                    overlaps.append(1)
                client.decr("holders")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert count[0] == 160
    assert not overlaps


def test_fences_strictly_increase_over_1000_sequential_acquisitions(redis_server):
    """Each acquisition of one name draws a fence above every earlier one."""
    client = redis_server.client()
    lock = Lock(client, "seq", timeout=5)
    fences = []
    for _ in range(1000):
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
    assert all(a < b for a, b in zip(fences, fences[1:]))


def test_contention_reports_the_holder_and_its_ttl(redis_server):
    """A refused acquisition knows who holds the lock and for how long."""
    client = redis_server.client()
    holder = Lock(client, "busy", timeout=10)
    assert holder.acquire(blocking=False, token="worker-1:task-42")
    waiter = Lock(client, "busy", timeout=10, blocking_timeout=0)
    with pytest.raises(LockNotAcquired) as info, waiter:
        pass
    assert info.value.holder == "worker-1:task-42"
    assert 9 < info.value.holder_ttl <= 10
    holder.release()
