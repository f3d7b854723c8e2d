"""Cancelling an acquire or a release never leaves a lock behind nor forgets one still held.

A cancelled round trip has an unknown outcome on the server. These tests cancel
while the server holds the command (it is paused, so the reply cannot come), then
let it answer, and check the key afterwards: an acquire that ran on the server
must have been undone, a release must have gone through.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time

import pytest

from celery_redlock.asyncio import Lock
from celery_redlock.core.fences import FENCE_COUNTER


async def in_flight(client) -> None:
    """Wait until a command of ``client`` is out and awaiting its reply."""
    pool = client.connection_pool
    while not pool._in_use_connections:  # the one public-enough sign of a pending reply
        await asyncio.sleep(0.001)


async def cancel_while_paused(redis_server, client, operation, *, finishes_first: bool):
    """Start ``operation`` with the server paused, cancel it once it is in flight, resume.

    With ``finishes_first`` the operation must still be running 0.3 s after the
    cancellation (it cannot finish while its reply is outstanding). Returns its
    task, which the caller awaits.
    """
    redis_server.pause()
    try:
        task = asyncio.ensure_future(operation)
        await in_flight(client)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.3)
        if finishes_first:
            assert not done
    finally:
        redis_server.resume()
    return task


@pytest.mark.parametrize("ttl", [None, 10])
def test_cancel_during_acquire_leaves_no_lock(arun, redis_server, ttl):
    """An acquire cancelled mid-flight waits for its reply and gives back what it took."""

    async def scenario(client):
        lock = Lock(client, "cancel-acquire", timeout=ttl)
        await client.ping()  # connected: the acquire itself is what waits for the server
        operation = lock.acquire(blocking=False)
        task = await cancel_while_paused(redis_server, client, operation, finishes_first=True)
        with pytest.raises(asyncio.CancelledError):
            await task
        # The acquire did run on the server (it drew a fence), and was undone.
        assert await client.exists(FENCE_COUNTER)
        assert await client.get("cancel-acquire") is None
        assert lock.token is None
        assert await Lock(client, "cancel-acquire", timeout=10).acquire(blocking=False)

    arun(scenario)


def test_cancel_while_connecting_leaves_nothing_held(arun, redis_server):
    """Cancelled while still connecting, an acquire leaves nothing held.

    Usually nothing was sent. redis-py sometimes swallows a cancellation that
    comes while it connects and sends the command anyway: the acquire then
    notices the cancellation it was asked for and gives back what it took.
    """

    async def scenario(client):
        lock = Lock(client, "cancel-connecting", timeout=10)
        # Not connected yet: the paused server holds up the connection's handshake.
        operation = lock.acquire(blocking=False)
        task = await cancel_while_paused(redis_server, client, operation, finishes_first=False)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await client.get("cancel-connecting") is None
        assert lock.token is None

    arun(scenario)


def test_cancel_before_the_release_is_sent_still_releases(arun, redis_server):
    """A release cancelled before its command went out is sent whole before CancelledError."""

    async def scenario(client):
        lock = Lock(client, "cancel-release-early", timeout=None, auto_renew=False)
        assert await lock.acquire(blocking=False)
        await client.connection_pool.disconnect()  # the release must connect first
        task = await cancel_while_paused(redis_server, client, lock.release(), finishes_first=True)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await client.get("cancel-release-early") is None

    arun(scenario)


def test_cancel_during_release_still_releases(arun, redis_server):
    """A release cancelled mid-flight finishes the delete before raising CancelledError."""

    async def scenario(client):
        lock = Lock(client, "cancel-release", timeout=None, auto_renew=False)
        assert await lock.acquire(blocking=False)
        task = await cancel_while_paused(redis_server, client, lock.release(), finishes_first=True)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await client.get("cancel-release") is None

    arun(scenario)


def test_cancel_during_release_of_a_renewed_lock_stops_renewing(arun, redis_server):
    """After a cancelled release of an auto-renewed lock, nothing renews or recreates it."""

    async def scenario(client):
        lock = Lock(client, "cancel-renewed", timeout=0.6, auto_renew=True)
        assert await lock.acquire(blocking=False)
        redis_server.pause()
        try:
            task = asyncio.ensure_future(lock.release())
            await in_flight(client)
            task.cancel()
        finally:
            redis_server.resume()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await client.get("cancel-renewed") is None
        await asyncio.sleep(0.5)  # longer than a renewal period: nothing may bring it back
        assert await client.get("cancel-renewed") is None
        assert not lock.lost

    arun(scenario)


def test_release_cancelled_before_it_starts_keeps_the_hold(arun):
    """A release cancelled before it ran did nothing: the hold is still known and renewed."""

    async def scenario(client):
        lock = Lock(client, "not-started", timeout=0.6, auto_renew=True)
        assert await lock.acquire(blocking=False)
        task = asyncio.ensure_future(lock.release())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.9)  # past the TTL: only renewal keeps it
        assert await lock.owned()
        await lock.release()
        assert await client.get("not-started") is None

    arun(scenario)


def test_random_cancellations_never_leak_or_forget_a_hold(arun):
    """300 acquires cancelled at random points: a cancelled one holds nothing, others hold."""

    async def scenario(client):
        rng = random.Random(10)
        outcomes = {"cancelled": 0, "acquired": 0}
        loop = asyncio.get_running_loop()
        # Cancel anywhere from before the send to after the reply, whatever this
        # machine's round trip takes: draw delays up to twice the typical acquire.
        durations = []
        for _ in range(21):
            started = time.monotonic()
            probe = Lock(client, "probe", timeout=10)
            assert await probe.acquire(blocking=False)
            durations.append(time.monotonic() - started)
            await probe.release()
        span = 2 * statistics.median(durations)
        for i in range(300):
            lock = Lock(client, "storm", timeout=None if i % 2 else 10)
            task = asyncio.ensure_future(lock.acquire(blocking=False))
            loop.call_later(rng.uniform(0, span), task.cancel)
            try:
                acquired = await task
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
                assert await client.get("storm") is None, f"round {i}: cancelled acquire leaked"
                continue
            assert acquired
            outcomes["acquired"] += 1
            # Finished before the cancel: the hold was recorded for the awaiting task.
            assert lock.local.token is not None or lock.token is not None
            assert await client.get("storm") is not None
            await client.delete("storm")
        assert outcomes["cancelled"] >= 10 and outcomes["acquired"] >= 10, outcomes

    arun(scenario)


def test_wait_for_timeout_on_a_held_lock_leaves_no_state(arun):
    """asyncio.wait_for() timing out a blocked acquire leaves neither a key nor a token."""

    async def scenario(client):
        holder = Lock(client, "waited", timeout=10)
        assert await holder.acquire(blocking=False)
        waiter = Lock(client, "waited", timeout=10, sleep=0.01)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(waiter.acquire(), 0.1)
        assert waiter.token is None
        assert await holder.owned()
        await holder.release()

    arun(scenario)


def test_wait_for_records_the_hold_for_the_caller(arun):
    """A hold taken through asyncio.wait_for() belongs to the task that called acquire()."""

    async def scenario(client):
        lock = Lock(client, "via-wait-for", timeout=10)
        assert await asyncio.wait_for(lock.acquire(), 1)
        assert lock.token is not None
        assert await lock.owned()
        await lock.release()
        assert await client.get("via-wait-for") is None

    arun(scenario)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout() is new in 3.11")
def test_asyncio_timeout_during_an_acquire_in_flight_becomes_timeout_error(arun, redis_server):
    """asyncio.timeout() expiring mid-acquire raises TimeoutError once the attempt is undone."""

    async def scenario(client):
        lock = Lock(client, "timed", timeout=None)
        await client.ping()  # connected: the acquire itself is what waits for the server
        redis_server.pause()
        loop = asyncio.get_running_loop()
        # Resume the server a little after the timeout fires, from the loop itself.
        loop.call_later(0.3, redis_server.resume)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await lock.acquire(blocking=False)
        assert await client.exists(FENCE_COUNTER)  # the acquire ran on the server...
        assert await client.get("timed") is None  # ...and was undone
        assert lock.token is None

    arun(scenario)
