"""Scripts sent again after a connection error are right whether or not the first send ran.

A connection error leaves a client unsure: a server that closed an idle
connection never ran the command, a reply lost on the way back means it did.
Both are met here: a :class:`ReplyDroppingProxy` loses a reply after the
server ran the command, and ``CLIENT KILL`` closes a connection before the
next command is sent. Also covers the same token offered by two acquirers, and
pools too small to spare a connection for the scripts' hot path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio

import celery_redlock.asyncio
from celery_redlock import Lock, Redlock
from tests.fault_proxy import ReplyDroppingProxy
from tests.redis_servers import RedisServer

TTL = 10  # seconds; long enough never to expire during a test


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[ReplyDroppingProxy]:
    with ReplyDroppingProxy(redis_server.port) as proxy:
        yield proxy


def _cache_scripts(client: redis.Redis) -> None:
    # A reply lost on a fresh server would be NOSCRIPT, after which nothing ran.
    warm = Lock(client, "warm-up", timeout=TTL)
    assert warm.acquire()
    warm.reacquire()
    warm.release()


@pytest.fixture(params=["reserved", "per call"])
def proxied(request: pytest.FixtureRequest, proxy: ReplyDroppingProxy) -> Iterator[redis.Redis]:
    """A client through the proxy, on a pool the scripts reserve a connection from, or not."""
    max_connections = None if request.param == "reserved" else 2
    client = redis.Redis.from_url(proxy.url, max_connections=max_connections)
    _cache_scripts(client)
    yield client
    client.close()


def test_a_second_lock_offered_the_same_token_is_refused(r: redis.Redis) -> None:
    """Two acquirers with one token do not both hold the lock, as with redis-py's Lock."""
    first = Lock(r, "same-token", timeout=TTL, blocking=False)
    second = Lock(r, "same-token", timeout=TTL, blocking=False)
    assert first.acquire(token="worker-1")
    assert not second.acquire(token="worker-1")
    assert second.token is None
    first.release()
    assert second.acquire(token="worker-1")


def test_a_second_asyncio_lock_offered_the_same_token_is_refused(
    redis_server: RedisServer,
) -> None:
    """The asyncio lock refuses a token that another acquirer already holds the lock with."""

    async def scenario() -> tuple[bool, bool]:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            first = celery_redlock.asyncio.Lock(client, "same-token", timeout=TTL, blocking=False)
            second = celery_redlock.asyncio.Lock(client, "same-token", timeout=TTL, blocking=False)
            return await first.acquire(token="worker-1"), await second.acquire(token="worker-1")
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == (True, False)


def test_a_second_redlock_offered_the_same_token_is_refused(redis_servers) -> None:
    """Each master refuses the second Redlock acquirer of a token, so it wins no majority."""
    clients = [server.client() for server in redis_servers(3)]
    first = Redlock(clients, "same-token", timeout=TTL, blocking=False)
    second = Redlock(clients, "same-token", timeout=TTL, blocking=False)
    assert first.acquire(token="worker-1")
    assert not second.acquire(token="worker-1")
    first.release()


def test_an_acquire_whose_reply_was_lost_holds_the_lock(
    proxied: redis.Redis, proxy: ReplyDroppingProxy, r: redis.Redis
) -> None:
    """The resend of an acquire that ran finds the lock its own, with a fresh fence."""
    proxied.ping()  # a connection to lose
    lock = Lock(proxied, "lost-acquire", timeout=TTL, blocking=False)
    proxy.drop_next_replies(1)
    assert lock.acquire()
    assert proxy.dropped == 1
    assert r.get("lost-acquire") == lock.token
    assert lock.fence is not None
    lock.release()
    assert r.exists("lost-acquire") == 0


def test_a_release_whose_reply_was_lost_succeeds(
    proxied: redis.Redis, proxy: ReplyDroppingProxy, r: redis.Redis
) -> None:
    """A release that deleted the key before its reply was lost does not report the lock lost."""
    lock = Lock(proxied, "lost-release", timeout=TTL)
    assert lock.acquire()
    proxy.drop_next_replies(1)
    lock.release()  # the resend finds the key gone: the first send deleted it
    assert proxy.dropped == 1
    assert lock.lease is not None and not lock.lease.lost
    assert r.exists("lost-release") == 0


def test_a_resent_release_still_spares_another_holder(
    proxied: redis.Redis, proxy: ReplyDroppingProxy, r: redis.Redis
) -> None:
    """A missing key counts as released on a resend; a key someone else holds never does."""
    lock = Lock(proxied, "taken-over", timeout=TTL)
    assert lock.acquire()
    r.set("taken-over", b"someone-else")
    proxy.drop_next_replies(1)
    with pytest.raises(celery_redlock.LockNotOwned):
        lock.release()
    assert r.get("taken-over") == b"someone-else"


def test_an_extend_whose_reply_was_lost_is_not_added_twice(
    proxied: redis.Redis, proxy: ReplyDroppingProxy, r: redis.Redis
) -> None:
    """extend() adds its time once: after a lost reply it raises instead of adding it again."""
    lock = Lock(proxied, "lost-extend", timeout=TTL)
    assert lock.acquire()
    proxy.drop_next_replies(1)
    with pytest.raises(redis.ConnectionError):
        lock.extend(TTL)
    assert proxy.dropped == 1
    assert TTL * 1000 < r.pttl("lost-extend") <= 2 * TTL * 1000
    lock.extend(TTL)  # the connection recovered
    assert 2 * TTL * 1000 < r.pttl("lost-extend") <= 3 * TTL * 1000
    lock.release()


def test_a_reacquire_whose_reply_was_lost_is_sent_again(
    proxied: redis.Redis, proxy: ReplyDroppingProxy, r: redis.Redis
) -> None:
    """Setting the TTL is the same done twice, so reacquire() and the watchdog resend it."""
    lock = Lock(proxied, "lost-reacquire", timeout=TTL)
    assert lock.acquire()
    proxy.drop_next_replies(1)
    assert lock.reacquire()
    assert proxy.dropped == 1
    assert 0 < r.pttl("lost-reacquire") <= TTL * 1000
    lock.release()


def test_asyncio_release_and_extend_after_lost_replies(
    proxy: ReplyDroppingProxy, r: redis.Redis
) -> None:
    """The asyncio lock resends a release after a lost reply, and never an extend()."""

    async def scenario() -> None:
        client = redis.asyncio.Redis.from_url(proxy.url)
        try:
            _cache_scripts(r)
            lock = celery_redlock.asyncio.Lock(client, "lost-async", timeout=TTL)
            assert await lock.acquire()
            proxy.drop_next_replies(1)
            with pytest.raises(redis.ConnectionError):
                await lock.extend(TTL)
            assert TTL * 1000 < r.pttl("lost-async") <= 2 * TTL * 1000
            await client.ping()  # reconnect first: lose the release's reply, not the handshake's
            proxy.drop_next_replies(1)
            await lock.release()
            assert proxy.dropped == 2
        finally:
            await client.aclose()

    asyncio.run(scenario())
    assert r.exists("lost-async") == 0


def test_a_redlock_release_whose_replies_were_lost_succeeds(redis_servers) -> None:
    """Masters whose release replies were lost count as released when the resend finds no key."""
    servers = redis_servers(3)
    proxies = [ReplyDroppingProxy(server.port) for server in servers]
    try:
        for server in servers:
            _cache_scripts(server.client())
        lock = Redlock([p.url for p in proxies], "lost-redlock", timeout=TTL)
        assert lock.acquire()
        for p in proxies:
            p.drop_next_replies(1)
        lock.release()
        assert [p.dropped for p in proxies] == [1, 1, 1]
        assert [server.client().exists("lost-redlock") for server in servers] == [0, 0, 0]
    finally:
        for p in proxies:
            p.close()


def _kill_other_clients(server: RedisServer) -> None:
    admin = server.client()
    admin.client_kill_filter(_type="normal", skipme=True)
    admin.close()


@pytest.mark.parametrize("max_connections", [None, 2])
def test_operations_after_the_server_closed_the_connection_succeed(
    redis_server: RedisServer, max_connections: int | None
) -> None:
    """A connection closed while idle is replaced: nothing fails, nothing runs twice."""
    client = redis_server.client(max_connections=max_connections)
    lock = Lock(client, "idle-closed", timeout=TTL)
    assert lock.acquire()
    _kill_other_clients(redis_server)
    lock.extend(TTL)  # add mode, never resent: must not meet the dead connection
    assert TTL * 1000 < client.pttl("idle-closed") <= 2 * TTL * 1000
    _kill_other_clients(redis_server)
    lock.release()
    _kill_other_clients(redis_server)
    assert lock.acquire()
    lock.release()


def test_a_pool_of_one_connection_serves_the_lock_and_the_application(
    redis_server: RedisServer,
) -> None:
    """Scripts take no connection for good from a pool with none to spare."""
    client = redis_server.client(max_connections=1)
    lock = Lock(client, "pool-of-one", timeout=TTL)
    assert lock.acquire()
    assert lock.owned()
    assert client.get("something-else") is None
    lock.release()
    assert client.get("pool-of-one") is None


def test_a_blocking_pool_is_not_kept_waiting_by_the_lock(redis_server: RedisServer) -> None:
    """A BlockingConnectionPool gets its connection back after every script call.

    Were one kept, owned() would wait for it and fail after the pool's timeout.
    """
    pool = redis.BlockingConnectionPool(port=redis_server.port, max_connections=1, timeout=1)
    client = redis.Redis(connection_pool=pool)
    try:
        lock = Lock(client, "blocking-pool", timeout=TTL)
        assert lock.acquire()
        assert lock.owned()
        lock.release()
        assert client.get("blocking-pool") is None  # within the pool's timeout of 1 s
    finally:
        # A pool given to a client is not the client's to close.
        pool.disconnect()
