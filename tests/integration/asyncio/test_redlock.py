"""celery_redlock.asyncio.Redlock over three private masters: quorum, fences, undo, renewal."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio

from celery_redlock import ConfigurationError, LockNotAcquired, LockNotOwned, QuorumNotAchieved
from celery_redlock.asyncio import Redlock, drain
from celery_redlock.core.fences import FENCE_COUNTER


def run_on(servers, scenario, **client_kwargs):
    """Run ``await scenario(clients)`` with one asyncio client per server."""

    async def main():
        clients = [redis.asyncio.Redis.from_url(s.url, **client_kwargs) for s in servers]
        try:
            return await scenario(clients)
        finally:
            assert await drain(10)  # late releases go out before the clients close
            for client in clients:
                await client.aclose()

    return asyncio.run(main())


async def eventually(check, timeout=5.0):
    """Poll the coroutine function ``check`` until it returns true; ``False`` at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.01)
    return False


async def no_key(clients, key="rl"):
    """True once no master stores ``key``."""
    return not any([await c.exists(key) for c in clients])


def test_acquire_and_release_on_every_master(redis_servers):
    """A hold stores one token on all masters; release removes it everywhere."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10)
        assert lock.quorum == 2
        assert await lock.acquire(blocking=False)

        async def token_everywhere():
            return [await c.get("rl") for c in clients] == [lock.token] * 3

        # A majority holds it when acquire returns; the last master moments later.
        assert await eventually(token_everywhere)
        assert lock.fence and await lock.locked() and await lock.owned()
        assert not await Redlock(clients, "rl", timeout=10).acquire(blocking=False)
        await lock.release()
        assert await eventually(lambda: no_key(clients))

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
    """A token held on two of three masters: QuorumNotAchieved naming the holder on each."""
    servers = redis_servers(3)

    async def scenario(clients):
        for client in clients[:2]:
            await client.set("rl", "other-holder", px=8000)
        lock = Redlock(clients, "rl", timeout=10, blocking_timeout=0)
        with pytest.raises(QuorumNotAchieved) as info:
            async with lock:
                pass
        error = info.value
        assert error.holder == "other-holder"
        assert 7 < error.holder_ttl <= 8
        assert error.granted <= 1 and error.needed == 2
        for name in lock.nodes[:2]:
            assert isinstance(error.errors[name], LockNotAcquired)
            assert error.errors[name].holder == "other-holder"
        assert lock.local.holder[0] == "other-holder"
        # Its grant on the third master, if it was made, is undone there.
        assert await eventually(lambda: no_key(clients[2:]))

    run_on(servers, scenario)


def test_hung_master_costs_acquire_and_release_nothing(redis_servers):
    """One of three masters SIGSTOPped: no acquire or release waits for it."""
    servers = redis_servers(3)

    async def scenario(clients):
        # A node timeout longer than the window below: an acquire or release
        # that waited for the hung master could not return within it.
        lock = Redlock(clients, "rl", timeout=120, node_timeout=30)
        assert await lock.acquire(blocking=False)  # connections opened, scripts cached
        await lock.release()
        fence = int(await clients[2].get(FENCE_COUNTER))
        servers[2].pause()

        async def cycles():
            for _ in range(10):
                assert await lock.acquire(blocking=False), lock.local.failure
                await lock.release()

        try:
            await asyncio.wait_for(cycles(), 20)
        finally:
            servers[2].resume()
        # Once resumed it runs each queued acquire, then the release sent behind it.
        assert await eventually(lambda: no_key(clients))
        # Queued acquires met each other's keys there, so at least one (not all) granted.
        assert int(await clients[2].get(FENCE_COUNTER)) > fence

    run_on(servers, scenario)


def test_a_lost_vote_fails_at_once_despite_a_hung_master(redis_servers):
    """Two of three masters held by another: the attempt fails without waiting for the third."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10, node_timeout=2)
        assert await lock.acquire(blocking=False)
        await lock.release()
        for client in clients[:2]:
            await client.set("rl", "other-holder", px=8000)
        servers[2].pause()
        try:
            with pytest.raises(QuorumNotAchieved) as info:
                async with Redlock(clients, "rl", timeout=10, node_timeout=2, blocking_timeout=0):
                    pass
        finally:
            servers[2].resume()
        error = info.value
        # Not "no answer within the node timeout": the attempt ended before it.
        assert "not awaited" in str(error.errors[lock.nodes[2]])
        assert await eventually(lambda: no_key(clients[2:]))

    run_on(servers, scenario)


def test_two_of_three_down_fail_with_each_error_and_leave_no_key(redis_servers):
    """Two of three masters dead: QuorumNotAchieved names each; the survivor keeps no key."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10, blocking_timeout=0)
        assert await lock.acquire()
        await lock.release()
        servers[0].kill()
        servers[1].kill()
        with pytest.raises(QuorumNotAchieved) as info:
            async with lock:
                pass
        error = info.value
        assert error.granted <= 1 and error.needed == 2
        dead = {f"127.0.0.1:{s.port}/0" for s in servers[:2]}
        assert dead <= set(error.errors)
        assert all(isinstance(error.errors[n], redis.exceptions.ConnectionError) for n in dead)
        assert all(name in str(error) for name in dead)
        # The dead masters may refuse before the survivor grants: its grant then
        # lands after the vote was lost and is released right behind it, in the
        # background, which drain() waits for.
        assert await drain(10)
        assert not await clients[2].exists("rl")
        assert await clients[2].exists(FENCE_COUNTER)  # it had granted

    run_on(servers, scenario)


def test_late_grant_of_a_failed_attempt_is_released_when_it_lands(redis_servers):
    """A hung master's grant that lands after the attempt failed is deleted right behind it."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10, node_timeout=0.3)
        assert await lock.acquire(blocking=False)
        await lock.release()
        fence = int(await clients[2].get(FENCE_COUNTER))
        await clients[0].set("rl", "other-holder", px=30000)
        servers[2].pause()
        try:
            # 1 yes, 1 no, 1 silent: undecided until the node timeout, which
            # the error below names; the window is far beyond it.
            assert not await asyncio.wait_for(lock.acquire(blocking=False), 10)
            assert not await clients[1].exists("rl")  # the grant that answered: undone
        finally:
            servers[2].resume()
        error = lock.local.failure
        assert "node timeout" in str(error.errors[lock.nodes[2]])
        assert await eventually(lambda: no_key(clients[1:]))
        assert int(await clients[2].get(FENCE_COUNTER)) == fence + 1  # the late grant landed
        assert await clients[0].get("rl") == b"other-holder"

    run_on(servers, scenario)


def test_the_largest_fence_is_raised_on_a_majority(redis_servers):
    """Counters that ran apart: the largest fence of the first majority is raised on a majority."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10)
        assert await lock.acquire(blocking=False)
        first = lock.fence
        await lock.release()
        # Every pair of masters now draws two different fences. Each counter is
        # set: a master that ran the first acquire late (a loaded machine) seeded
        # its own from a later clock reading, anywhere between these.
        await clients[0].set(FENCE_COUNTER, first)
        await clients[1].set(FENCE_COUNTER, first + 500)
        await clients[2].set(FENCE_COUNTER, first + 1000)
        assert await lock.acquire(blocking=False)
        fence = lock.fence
        assert fence in (first + 501, first + 1001)
        # A majority holds it when acquire returns.
        fences = [int(await c.get(FENCE_COUNTER)) for c in clients]
        assert fences.count(fence) >= 2 and min(fences) <= fence <= max(fences)
        await lock.release()
        assert await lock.acquire(blocking=False)
        assert lock.fence > fence
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
    """An acquire cancelled while a majority is slow leaves nothing behind anywhere."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10, node_timeout=2)
        for server in servers[:2]:
            server.pause()
        try:
            task = asyncio.ensure_future(lock.acquire(blocking=False))
            while not await clients[2].exists("rl"):  # the fast master granted it
                await asyncio.sleep(0.005)
            task.cancel()
        finally:
            for server in servers[:2]:
                server.resume()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lock.token is None
        # Whatever the resumed masters granted, the release behind it deletes.
        assert await eventually(lambda: no_key(clients))

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
