"""The asyncio lock stays safe across paused holders, script flushes and server restarts.

Mirrors tests/integration/test_lock_failures.py for celery_redlock.asyncio.Lock.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

import pytest
import redis
import redis.asyncio

from celery_redlock import LockNotOwned, fence_key_for
from celery_redlock.asyncio import Lock
from celery_redlock.asyncio.scripts import run_script
from celery_redlock.core.fences import FENCE_COUNTER
from celery_redlock.core.scripts import ACQUIRE

FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"


def paused_holder(url: str, conn) -> None:
    async def main():
        client = redis.asyncio.Redis.from_url(url)
        lock = Lock(client, "paused", timeout=1, auto_renew=True)
        assert await lock.acquire(blocking=False)
        conn.send(lock.fence)
        # The parent stops us, takes the lock, resumes us, then says go.
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        outcome = {"lost_before_release": lock.lost}
        try:
            await lock.release()
            outcome["release"] = "released"
        except LockNotOwned:
            outcome["release"] = "LockNotOwned"
        await client.aclose()
        return outcome

    conn.send(asyncio.run(main()))


@pytest.mark.filterwarnings(FORK_WARNING)
def test_holder_paused_past_its_ttl_loses_and_cannot_hurt_the_new_holder(redis_server):
    """SIGSTOP beyond the TTL: the old holder learns it is lost and the new holder is safe."""
    client = redis_server.client()
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=paused_holder, args=(redis_server.url, child_end))
    child.start()
    try:
        old_fence = parent_end.recv()
        os.kill(child.pid, signal.SIGSTOP)
        import celery_redlock

        new = celery_redlock.Lock(client, "paused", timeout=10, sleep=0.05, blocking_timeout=5)
        assert new.acquire()
        assert new.fence > old_fence
    finally:
        os.kill(child.pid, signal.SIGCONT)
    parent_end.send("go")
    outcome = parent_end.recv()
    child.join(timeout=5)
    assert outcome == {"lost_before_release": True, "release": "LockNotOwned"}
    assert new.owned()
    new.release()


def test_every_operation_survives_script_flush(arun):
    """Acquire, extend, reacquire and release each work right after SCRIPT FLUSH."""

    async def scenario(client):
        lock = Lock(client, "flush", timeout=10)
        await client.script_flush()
        assert await lock.acquire(blocking=False)
        first = lock.fence
        await client.script_flush()
        assert await lock.extend(5)
        await client.script_flush()
        assert await lock.reacquire()
        await client.script_flush()
        await lock.release()
        await client.script_flush()
        assert await lock.acquire(blocking=False)
        assert lock.fence > first
        await lock.release()

    arun(scenario)


def test_restart_between_operations(arun, redis_server):
    """After a restart (empty dataset) the old hold is gone; new holds work, with higher fences."""

    async def scenario(client):
        old = Lock(client, "restart", timeout=10)
        assert await old.acquire(blocking=False)
        redis_server.restart()
        with pytest.raises(LockNotOwned):
            await old.release()
        new = Lock(client, "restart", timeout=10)
        assert await new.acquire(blocking=False)
        assert new.fence > old.lease.fence
        assert await new.extend(1)
        assert await new.reacquire()
        await new.release()

    arun(scenario)


def test_unreachable_server_raises_a_connection_error(arun, redis_server):
    """With the server gone, acquire raises ConnectionError rather than returning False."""

    async def scenario(client):
        redis_server.stop()
        with pytest.raises(redis.exceptions.ConnectionError):
            await Lock(client, "gone", timeout=1).acquire(blocking=False)

    arun(scenario, socket_connect_timeout=0.2)


def test_a_timed_out_reply_is_never_read_by_the_next_operation(arun, redis_server):
    """After a timeout the connection is dropped, so a late reply cannot answer a later call."""

    async def scenario(client):
        holder = Lock(client, "late", timeout=10)
        assert await holder.acquire(blocking=False)
        redis_server.pause()
        try:
            with pytest.raises(redis.exceptions.TimeoutError):
                await Lock(client, "late", timeout=10).acquire(blocking=False)
        finally:
            redis_server.resume()
        await holder.release()
        assert await client.get("late") is None
        other = Lock(client, "late", timeout=10)
        assert await other.acquire(blocking=False)
        assert other.fence > holder.lease.fence
        await other.release()

    arun(scenario, socket_timeout=0.3)


def test_a_resent_acquire_is_idempotent(arun):
    """An acquire whose reply was lost and is sent again finds its own token and holds the lock.

    Only the resend (ARGV[4] "1", sent by run_script) may: a first send with a
    token that holds the lock is another acquirer's, and is refused.
    """

    async def scenario(client):
        first = Lock(client, "resent", timeout=10)
        assert await first.acquire(blocking=False, token="attempt-1")
        await client.pexpire("resent", 2000)
        keys = ("resent", fence_key_for("resent"))
        refused = await run_script(ACQUIRE, client, keys, ("attempt-1", 10000, 3600000, "0"))
        assert isinstance(refused, list)
        fence = await run_script(ACQUIRE, client, keys, ("attempt-1", 10000, 3600000, "1"))
        assert fence > first.fence
        assert 9000 < await client.pttl("resent") <= 10000
        assert not await Lock(client, "resent", timeout=10).acquire(blocking=False, token="x")

    arun(scenario)


def test_single_connection_clients_and_bytes_names_work(arun):
    """Byte-string names and single-connection clients, both accepted by redis-py, work too."""

    async def scenario(client):
        lock = client.lock(b"bytes-name", timeout=5, lock_class=Lock)
        async with lock:
            assert await client.get(b"bytes-name") == lock.token
            assert await client.exists(FENCE_COUNTER.encode())
        assert not await client.exists(b"bytes-name")

    arun(scenario, single_connection_client=True)
