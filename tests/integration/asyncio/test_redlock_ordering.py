"""asyncio Redlock: requests queued behind a hung master, and late releases of failed attempts.

Requests for one key through one client run one after another, so a release
never overtakes its acquire. These tests check that the queue a hung master
(no ``socket_timeout``, redis-py's default) leaves stays small, that a release
it owes still goes out, and that each attempt stores a value of its own, so a
release that lands late cannot delete a later attempt's grant.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions

from celery_redlock.asyncio import Redlock, drain
from celery_redlock.asyncio.redlock import MAX_PENDING
from celery_redlock.core.holder import Holder
from celery_redlock.core.scripts import RELEASE
from tests.integration.asyncio.test_redlock import eventually, no_key, run_on


async def warm(lock):
    """Open every master's connection and cache the scripts, then wait for the release."""
    assert await lock.acquire(blocking=False)
    await lock.release()
    assert await drain(5)


@pytest.mark.timeout(30)
def test_a_hung_master_keeps_a_bounded_backlog_and_fails_at_once(redis_servers):
    """200 cycles with a master hung leave a few requests pending, and it then fails at once."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=30, node_timeout=0.5)
        await warm(lock)
        servers[2].pause()
        try:
            for _ in range(200):
                assert await lock.acquire(blocking=False), lock.local.failure
                await lock.release()
            backlog = len(asyncio.all_tasks()) - 1  # this scenario's own task aside
            assert backlog <= 2 * MAX_PENDING, f"{backlog} requests pending"
            # Another holder on a master: the vote needs the hung one, which
            # now fails at once instead of costing the node timeout.
            await clients[0].set("rl", "other-holder", px=30000)
            assert not await lock.acquire(blocking=False)
            error = lock.local.failure.errors[lock.nodes[2]]
            await clients[0].delete("rl")
        finally:
            servers[2].resume()
        # Failed at once for the backlog, not after waiting out the node timeout
        # (that error would say "no answer within the node timeout").
        assert isinstance(error, redis.exceptions.ConnectionError), error
        assert "pending" in str(error)
        # Resumed, the master runs what was queued (each release behind its
        # acquire) and takes part again.
        assert await drain(10)
        assert await no_key(clients)
        assert await lock.acquire(blocking=False)
        assert await eventually(lambda: _holds(clients[2], lock.token))
        await lock.release()

    run_on(servers, scenario)


@pytest.mark.timeout(30)
def test_a_release_owed_to_a_hung_master_is_queued_past_the_bound(redis_servers):
    """A hold's release reaches a hung master behind the renewals that filled its queue."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=30, node_timeout=0.5)
        await warm(lock)
        assert await lock.acquire(blocking=False)
        assert await eventually(lambda: _holds(clients[2], lock.token))
        servers[2].pause()
        try:
            for _ in range(2 * MAX_PENDING):
                assert await lock.extend(30, replace_ttl=True)
            await lock.release()
        finally:
            servers[2].resume()
        # Without the release the key would stay there for its 30 s TTL.
        assert await eventually(lambda: no_key(clients), timeout=5)

    run_on(servers, scenario)


@pytest.mark.timeout(30)
def test_each_attempt_stores_its_own_value_so_a_late_release_spares_the_next(redis_servers):
    """A retry stores ``token|N``; the first attempt's release, run late, deletes nothing."""
    servers = redis_servers(3)

    async def scenario(clients):
        lock = Redlock(clients, "rl", timeout=10)
        await warm(lock)
        # Two masters refuse for 0.3 s: the first attempt fails (its grant on
        # the third is undone), a retry succeeds.
        for client in clients[:2]:
            await client.set("rl", "someone else", px=300)
        holder = Holder.new("task-1", "celery@here", ttl=10, queue="q")
        value = holder.encode().encode()
        assert await lock.acquire(token=value, sleep=0.1, blocking_timeout=3)
        stored = lock.token
        assert stored is not None and stored != value and stored.startswith(value + b"|")
        assert Holder.parse(stored) == holder
        assert await eventually(lambda: _holds_everywhere(clients, stored))
        # The first attempt's release, as a master that got it late would run it.
        for client in clients:
            assert await client.eval(RELEASE.source, 1, "rl", value, "0") == 0
        assert await _holds_everywhere(clients, stored)
        assert not await Redlock(clients, "rl", timeout=10).acquire(blocking=False)
        await lock.release()
        assert await eventually(lambda: no_key(clients))
        # A new acquire() with the token of the last attempt gets a value of its own too.
        assert await lock.acquire(token=value, blocking=False)
        assert lock.token not in (value, stored) and lock.token.startswith(value + b"|")
        await lock.release()

    run_on(servers, scenario)


async def _holds(client, value):
    return await client.get("rl") == value


async def _holds_everywhere(clients, value):
    return all([await _holds(client, value) for client in clients])
