"""asyncio Redlock when masters fail: down, hung, replies lost, the caller cancelled, loop ends.

Each test runs three private masters and checks what a user relies on: the
lock excludes, no key is left on a master that may have run an acquire
(beyond the TTL of one that cannot be reached), nothing waits past the node
timeout, and nothing is sent to a master that never got the acquire.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis
import redis.asyncio

from celery_redlock import QuorumNotAchieved
from celery_redlock.asyncio import Redlock, drain
from tests.fault_proxy import DelayProxy, ReplyDroppingProxy
from tests.integration.asyncio.test_redlock import eventually, no_key, run_on
from tests.integration.asyncio.test_redlock_ordering import warm
from tests.redis_topologies import wait_until


def connections_received(server):
    """How many connections ``server`` has accepted, through a client that is already connected."""
    return int(server.info("stats")["total_connections_received"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fencing", [True, False])
def test_a_lost_acquire_reply_leaves_no_key_after_release(redis_servers, fencing):
    """A master that ran the acquire but whose reply was lost counts as granting, and is released.

    Without fencing, the resend after the lost reply met the first send's key
    and answered "held by": the master counted as refusing, got no release,
    and kept the key until its TTL.
    """
    servers = redis_servers(3)
    proxy = ReplyDroppingProxy(servers[2].port)
    direct = servers[2].client()

    async def scenario(clients):
        clients.append(redis.asyncio.Redis.from_url(proxy.url))
        lock = Redlock(clients, "rl", timeout=30, fencing=fencing)
        await warm(lock)
        proxy.drop_next_replies(1)
        assert await lock.acquire(blocking=False)
        assert await drain(5)
        assert proxy.dropped == 1
        assert direct.get("rl") == lock.token  # the master behind the proxy ran it
        assert not await Redlock(clients, "rl", timeout=30).acquire(blocking=False)
        await lock.release()
        assert await eventually(lambda: no_key(clients), timeout=3)
        # A lost release reply: the resend finds the key gone and counts it released.
        assert await lock.acquire(blocking=False)
        assert await drain(5)
        proxy.drop_next_replies(1)
        await lock.release()
        assert await eventually(lambda: no_key(clients), timeout=3)
        assert proxy.dropped == 2

    try:
        run_on(servers[:2], scenario)
    finally:
        proxy.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wins", [True, False])
def test_a_release_goes_behind_an_acquire_whose_reply_outlived_the_socket_timeout(
    redis_servers, wins
):
    """An acquire whose reply comes after the client's socket_timeout is released after it runs.

    The third master gets the acquire 1 s late, past the clients' 0.2 s
    socket_timeout. The release (of the lock won without it, or the undo of
    an attempt the second master refused) used to go on a new connection
    once the client gave up on the acquire, reach the master first, and
    leave the late acquire's key there until its TTL.
    """
    servers = redis_servers(3)
    proxy = DelayProxy(servers[2].port)
    direct = servers[2].client()

    async def scenario(clients):
        clients.append(redis.asyncio.Redis.from_url(proxy.url, socket_timeout=0.2))
        lock = Redlock(clients, "rl", timeout=30, node_timeout=0.4)
        # Every vote of the warm-up waits for the third master: nothing left on its way.
        await clients[0].set("rl", "someone else")
        await warm(lock)
        await clients[0].delete("rl")
        servers[2].reset_stats()
        if not wins:
            await clients[1].set("rl", "someone else", px=30000)
        proxy.hold(time.monotonic() + 1.0, only_open=True)
        assert await lock.acquire(blocking=False) is wins, lock.local.failure
        if wins:
            await lock.release()

        async def acquire_ran():
            # The acquire script draws a fence (INCR) when it takes the key.
            return servers[2].commandstats().get("incr", 0) >= 1

        async def no_key_there():
            return direct.exists("rl") == 0

        assert await eventually(acquire_ran, timeout=5)
        assert await eventually(no_key_there, timeout=3)
        assert await drain(5)
        assert direct.exists("rl") == 0
        # The next attempts go through the third master again.
        await clients[1].delete("rl")
        await clients[0].set("rl", "someone else")
        assert await lock.acquire(blocking=False), lock.local.failure
        assert direct.get("rl") == lock.token
        await lock.release()
        await clients[0].delete("rl")

    try:
        run_on(servers[:2], scenario, socket_timeout=0.2)
    finally:
        proxy.close()


@pytest.mark.timeout(60)
def test_an_acquire_never_written_to_a_hung_master_gets_no_undo(redis_servers):
    """An acquire whose connection's handshake timed out was never written: no undo goes after it.

    The third master is paused before any connection to it, so the acquire's
    new connection times out in redis-py's handshake (``CLIENT SETINFO``)
    before the script is written. The undo queued behind it used to open
    another connection and wait out another socket timeout.
    """
    servers = redis_servers(3)
    third = servers[2].client()
    third.ping()

    async def scenario(clients):
        for client in clients[:2]:
            await client.set("rl", "someone else", px=30000)
        lock = Redlock(clients, "rl", timeout=30, node_timeout=2)
        before = connections_received(third)
        servers[2].pause()
        try:
            started = time.monotonic()
            assert not await lock.acquire(blocking=False)  # refused by two at once
            assert time.monotonic() - started < 0.4
            assert await drain(5)
        finally:
            servers[2].resume()
        # The acquire's one connection, accepted on resume; an undo would be a second.
        assert connections_received(third) - before == 1
        assert third.exists("rl") == 0
        assert servers[2].commandstats().get("evalsha", 0) == 0

    run_on(servers, scenario, socket_timeout=0.5)


@pytest.mark.timeout(60)
def test_no_release_goes_to_a_master_that_was_down_at_acquire(redis_servers):
    """A master that refused the acquire's connection gets no release, even once it is back."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=30)
        await warm(lock)
        servers[2].kill()
        assert await lock.acquire(blocking=False), lock.local.failure
        error = lock.local.failure
        assert error is None
        servers[2].restart()
        servers[2].reset_stats()
        await lock.release()
        assert await drain(5)
        assert await no_key(clients)
        stats = servers[2].commandstats()
        assert stats.get("evalsha", 0) == stats.get("eval", 0) == 0, stats
        # It takes part again in the next acquire.
        assert await lock.acquire(blocking=False)
        assert await eventually(lambda: _holds(clients[2], lock.token))
        await lock.release()

    run_on(servers, scenario)


@pytest.mark.timeout(60)
def test_a_release_with_a_majority_hung_fails_within_the_node_timeout_and_lands_later(
    redis_servers,
):
    """Two of three masters hung: release raises QuorumNotAchieved in time; resumed, they delete."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=30, node_timeout=0.5)
        await warm(lock)
        assert await lock.acquire(blocking=False)
        assert await eventually(lambda: _holds_everywhere(clients, lock.token))
        for server in servers[1:]:
            server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(QuorumNotAchieved):
                await lock.release()
            assert time.monotonic() - started < 1.5
            # Nothing else can take the lock meanwhile: the hung masters still hold it.
            assert not await clients[0].exists("rl")
        finally:
            for server in servers[1:]:
                server.resume()
        # The releases queued on the hung masters run once they resume.
        assert await eventually(lambda: no_key(clients), timeout=5)

    run_on(servers, scenario)


@pytest.mark.timeout(60)
def test_an_acquire_cancelled_with_one_master_down_and_one_hung_leaves_nothing(redis_servers):
    """Cancelled mid-vote (one master refused, one hung): back in time, and no key stays."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=30, node_timeout=1)
        await warm(lock)
        servers[0].kill()
        servers[1].pause()
        try:
            task = asyncio.ensure_future(lock.acquire(blocking=False))
            assert await eventually(lambda: clients[2].exists("rl"))  # granted by the third
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The vote waits out the node timeout, then the undo its own.
            assert time.monotonic() - started < 3
            assert lock.token is None
            assert not await clients[2].exists("rl")  # the grant that answered: undone
        finally:
            servers[1].resume()
        assert await eventually(lambda: no_key(clients[1:]), timeout=5)

    run_on(servers, scenario, socket_connect_timeout=0.5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("awaited", [True, False])
def test_the_loop_ending_with_a_release_in_flight_is_quiet(redis_servers, caplog, awaited):
    """asyncio.run() ending while a release waits on a hung master: no errors or warnings logged.

    With ``awaited`` the release returned (won on the other two) and only its
    request to the hung master is left; without, the release itself is still
    waiting (two masters hung) when the main coroutine returns. The suite runs
    with warnings as errors and fails a test that leaves a socket to the
    garbage collector.
    """
    servers = redis_servers(3)
    hung = servers[1:] if not awaited else servers[2:]

    async def main():
        clients = [redis.asyncio.Redis.from_url(s.url) for s in servers]
        lock = Redlock(clients, "rl", timeout=30, node_timeout=0.5)
        await warm(lock)
        assert await lock.acquire(blocking=False)
        assert await drain(5)
        for server in hung:
            server.pause()
        if awaited:
            await lock.release()
        else:
            releasing = asyncio.ensure_future(lock.release())
            await asyncio.sleep(0.05)
            assert not releasing.done()
        for client in clients:
            await client.aclose()

    caplog.set_level(logging.DEBUG, logger="asyncio")
    # Set on the logger itself: an in-process Celery worker of an earlier test may
    # have left the root logger above WARNING, which would hide our warnings.
    caplog.set_level(logging.DEBUG, logger="celery_redlock")
    try:
        asyncio.run(main())
    finally:
        for server in hung:
            server.resume()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    # The releases were written before the clients closed: the masters run them on resuming.
    check = [server.client() for server in servers]
    wait_until(lambda: not any(c.exists("rl") for c in check), 5, "the resumed masters' releases")


async def _holds(client, value):
    return await client.get("rl") == value


async def _holds_everywhere(clients, value):
    return all([await _holds(client, value) for client in clients])
