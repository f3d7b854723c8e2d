"""celery_redlock.asyncio.Redlock over three private masters: quorum, fences, undo, renewal."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio

from celery_redlock import ConfigurationError, LockNotAcquired, LockNotOwned
from celery_redlock.asyncio import Redlock


def run_on(servers, scenario, **client_kwargs):
    """Run ``await scenario(clients)`` with one asyncio client per server."""

    async def main():
        clients = [redis.asyncio.Redis.from_url(s.url, **client_kwargs) for s in servers]
        try:
            return await scenario(clients)
        finally:
            for client in clients:
                await client.aclose()

    return asyncio.run(main())


def test_acquire_and_release_on_every_master(redis_servers):
    """A hold stores one token on all masters; release removes it everywhere."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10)
        assert lock.quorum == 2
        assert await lock.acquire(blocking=False)
        assert [await c.get("rl") for c in clients] == [lock.token] * 3
        assert lock.fence and await lock.locked() and await lock.owned()
        assert not await Redlock(clients, "rl", timeout=10).acquire(blocking=False)
        await lock.release()
        assert [await c.exists("rl") for c in clients] == [0, 0, 0]

    run_on(servers, scenario)


def test_a_minority_down_still_locks_and_a_majority_down_leaves_nothing(redis_servers):
    """One of three masters down: the lock works; two down: no hold, no leftover key."""
    servers = redis_servers(3)

    async def scenario(clients):
        servers[2].stop()
        lock = Redlock(clients, "rl", timeout=10)
        assert await lock.acquire(blocking=False)
        assert await lock.extend(5)
        await lock.release()
        servers[1].stop()
        assert not await lock.acquire(blocking=False)
        assert not await clients[0].exists("rl")  # the granted master was undone

    run_on(servers, scenario, socket_connect_timeout=0.2)


def test_a_holder_on_a_majority_is_reported(redis_servers):
    """A token held on two of three masters refuses the lock and is named as holder."""
    servers = redis_servers(3)

    async def scenario(clients):
        for client in clients[:2]:
            await client.set("rl", "other-holder", px=8000)
        with pytest.raises(LockNotAcquired) as info:
            async with Redlock(clients, "rl", timeout=10, blocking_timeout=0):
                pass
        assert info.value.holder == "other-holder"
        assert 7 < info.value.holder_ttl <= 8
        assert not await clients[2].exists("rl")  # its grant there was undone

    run_on(servers, scenario)


def test_the_largest_fence_is_raised_on_a_majority(redis_servers):
    """A master whose counter ran ahead sets the fence; the others are raised to it."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10)
        assert await lock.acquire(blocking=False)
        first = lock.fence
        await lock.release()
        await clients[2].set("{rl}:fence", first + 1000)
        assert await lock.acquire(blocking=False)
        assert lock.fence == first + 1001
        assert [int(await c.get("{rl}:fence")) for c in clients] == [first + 1001] * 3
        await lock.release()
        assert await lock.acquire(blocking=False)
        assert lock.fence == first + 1002
        await lock.release()

    run_on(servers, scenario)


def test_auto_renewal_keeps_the_lock_on_every_master(redis_servers):
    """A 0.6 s lock held 1.5 s with auto_renew stays ours on all masters."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=0.6, auto_renew=True)
        assert await lock.acquire(blocking=False)
        await asyncio.sleep(1.5)
        assert await lock.owned() and not lock.lost
        assert lock.lease.renewals >= 3
        await lock.release()

    run_on(servers, scenario)


def test_lock_taken_away_on_a_majority_is_lost(redis_servers):
    """Overwriting the key on two masters makes release raise LockNotOwned."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10)
        assert await lock.acquire(blocking=False)
        for client in clients[:2]:
            await client.set("rl", "thief")
        with pytest.raises(LockNotOwned):
            await lock.release()
        assert lock.lease.lost

    run_on(servers, scenario)


def test_tasks_exclude_each_other_and_fences_rise(redis_servers):
    """Ten tasks on three masters never hold the lock together; fences rise in hold order."""
    servers = redis_servers(3)
    intervals = []

    async def scenario(clients):
        async def worker():
            for _ in range(8):
                lock = Redlock(clients, "rl", timeout=5, sleep=0.005, blocking_timeout=30)
                assert await lock.acquire()
                start = time.monotonic()
                await asyncio.sleep(0.001)
                intervals.append((start, time.monotonic(), lock.fence))
                await lock.release()

        await asyncio.gather(*(worker() for _ in range(10)))

    run_on(servers, scenario)
    intervals.sort()
    assert len(intervals) == 80
    for (_, end, _), (start, _, _) in zip(intervals, intervals[1:]):
        assert end <= start
    fences = [fence for *_, fence in intervals]
    assert fences == sorted(set(fences))


def test_cancelled_acquire_leaves_no_key_on_any_master(redis_servers):
    """An acquire cancelled while a master is slow leaves nothing behind anywhere."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10, node_timeout=2)
        servers[0].pause()
        try:
            task = asyncio.ensure_future(lock.acquire(blocking=False))
            while not await clients[1].exists("rl"):  # the fast masters granted it
                await asyncio.sleep(0.005)
            task.cancel()
        finally:
            servers[0].resume()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [await c.exists("rl") for c in clients] == [0, 0, 0]
        assert lock.token is None

    run_on(servers, scenario)


def test_bad_arguments_are_named(redis_servers):
    """No masters, a node timeout not below the TTL, or a master twice: ConfigurationError."""
    servers = redis_servers(1)

    async def scenario(clients):
        with pytest.raises(ConfigurationError) as info:
            Redlock([], "rl")
        assert info.value.setting == "masters"
        with pytest.raises(ConfigurationError) as info:
            Redlock(clients, "rl", timeout=1, node_timeout=1)
        assert info.value.setting == "node_timeout"
        twin = redis.asyncio.Redis.from_url(servers[0].url)
        with pytest.raises(ConfigurationError) as info:
            Redlock([clients[0], twin], "rl")
        assert info.value.setting == "masters"
        await twin.aclose()

    run_on(servers, scenario)
