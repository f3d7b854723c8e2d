"""The asyncio lock under real contention: processes, and tasks on one loop.

Mirrors tests/integration/test_lock_exclusion.py for celery_redlock.asyncio.Lock.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio

from celery_redlock import LockNotAcquired
from celery_redlock.asyncio import Lock
from tests.hold_log import assert_serial_holds, run_contenders

FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"


def hold_repeatedly(url: str, rounds: int, hold: float, results) -> None:
    """Take the lock ``rounds`` times; inside each hold, prove nobody else holds it."""

    async def main():
        client = redis.asyncio.Redis.from_url(url)
        intervals = []
        try:
            for _ in range(rounds):
                lock = Lock(client, "exclusive", timeout=5, sleep=0.002, blocking_timeout=60)
                assert await lock.acquire()
                start = time.monotonic()
                holders = await client.incr("holders")
                await client.rpush("fences", lock.fence)
                await asyncio.sleep(hold)
                await client.decr("holders")
                end = time.monotonic()
                await lock.release()
                intervals.append((start, end, holders, lock.lease.fence))
        finally:
            await client.aclose()
        return intervals

    try:
        results.put(("ok", asyncio.run(main())))
    except BaseException as exc:  # report, so the parent fails with the cause
        results.put(("error", repr(exc)))


@pytest.mark.filterwarnings(FORK_WARNING)
@pytest.mark.timeout(120)
def test_thirty_processes_exclude_each_other_and_fences_follow_hold_order(redis_server):
    """30 forked contenders, each on its own loop: holds never overlap, fences rise in order."""
    intervals = run_contenders(hold_repeatedly, 30, redis_server.url, 4, 0.002)
    assert_serial_holds(intervals, 120)
    fences = [int(f) for f in redis_server.client().lrange("fences", 0, -1)]
    assert all(a < b for a, b in zip(fences, fences[1:])), "fences not increasing in hold order"
    assert [fence for *_, fence in sorted(intervals)] == fences


@pytest.mark.parametrize("decode", [False, True])
def test_tasks_sharing_one_client_exclude_each_other(arun, decode):
    """16 tasks on one client (one connection pool) never hold the lock together."""
    intervals: list = []

    async def worker(client):
        for _ in range(15):
            lock = Lock(client, "shared", timeout=5, sleep=0.001, blocking_timeout=30)
            assert await lock.acquire()
            start = time.monotonic()
            holders = await client.incr("holders")
            await asyncio.sleep(0.001)
            await client.decr("holders")
            end = time.monotonic()
            await lock.release()
            intervals.append((start, end, holders, lock.lease.fence))

    async def scenario(client):
        await asyncio.gather(*(worker(client) for _ in range(16)))

    arun(scenario, decode_responses=decode)
    assert_serial_holds(intervals, 16 * 15)


def test_one_lock_instance_shared_by_tasks(arun):
    """A single Lock object used from many tasks keeps each task's hold separate."""
    count = [0]
    overlaps = []

    async def scenario(client):
        lock = Lock(client, "instance", timeout=5, sleep=0.001, blocking_timeout=30)

        async def worker():
            for _ in range(20):
                async with lock:
                    count[0] += 1
                    if await client.incr("holders") != 1:
                        overlaps.append(1)
                    await asyncio.sleep(0)
                    await client.decr("holders")

        await asyncio.gather(*(worker() for _ in range(8)))

    arun(scenario)
    assert count[0] == 160
    assert not overlaps


def test_fences_strictly_increase_over_sequential_acquisitions(arun):
    """Each acquisition of one name draws a fence above every earlier one."""

    async def scenario(client):
        lock = Lock(client, "seq", timeout=5)
        fences = []
        for _ in range(500):
            assert await lock.acquire(blocking=False)
            fences.append(lock.fence)
            await lock.release()
        return fences

    fences = arun(scenario)
    assert all(a < b for a, b in zip(fences, fences[1:]))


def test_contention_reports_the_holder_and_its_ttl(arun):
    """A refused acquisition knows who holds the lock and for how long."""

    async def scenario(client):
        holder = Lock(client, "busy", timeout=10)
        assert await holder.acquire(blocking=False, token="worker-1:task-42")
        waiter = Lock(client, "busy", timeout=10, blocking_timeout=0)
        with pytest.raises(LockNotAcquired) as info:
            async with waiter:
                pass
        assert info.value.holder == "worker-1:task-42"
        assert 9 < info.value.holder_ttl <= 10
        await holder.release()

    arun(scenario)
