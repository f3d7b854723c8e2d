"""Auto-renewal of the asyncio lock: a renewal task per lease keeps it and reports losses.

Mirrors tests/integration/test_lock_renewal.py for celery_redlock.asyncio.Lock.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

from celery_redlock.asyncio import Lock


def lost_event(kwargs: dict) -> tuple[asyncio.Event, dict]:
    """Return an event set by on_lost and kwargs that wire it in (call on the loop)."""
    event = asyncio.Event()
    return event, {**kwargs, "on_lost": lambda lease: event.set()}


def test_auto_renewed_lock_outlives_its_ttl_many_times(arun):
    """A 1 s lock held for 3 s with auto_renew is still ours, and never reported lost."""

    async def scenario(client):
        lock = Lock(client, "long", timeout=1, auto_renew=True)
        assert await lock.acquire(blocking=False)
        await asyncio.sleep(3)
        assert await lock.owned()
        assert not lock.lost
        assert lock.lease.renewals >= 7
        assert 0 < lock.remaining() <= 1
        await lock.release()
        assert await client.get("long") is None

    arun(scenario)


@pytest.mark.parametrize("tamper", ["delete", "overwrite"])
def test_lock_taken_away_is_reported_lost_within_one_renewal_period(arun, tamper):
    """Deleting or overwriting the key behind the holder's back is noticed at the next renewal."""

    async def scenario(client):
        event, kwargs = lost_event({"timeout": 1.5, "auto_renew": True})
        lock = Lock(client, "victim", **kwargs)
        assert await lock.acquire(blocking=False)
        if tamper == "delete":
            await client.delete("victim")
        else:
            await client.set("victim", "intruder", px=10_000)
        started = time.monotonic()
        await asyncio.wait_for(event.wait(), 2)
        assert time.monotonic() - started <= 1.5 / 3 + 0.25
        assert lock.lost
        assert lock.lease.loss_reason == "the key no longer holds this lease's token"
        if tamper == "overwrite":
            assert await client.get("victim") == b"intruder"

    arun(scenario)


def test_hung_server_marks_the_lock_lost_by_its_deadline(arun, redis_server):
    """A server that stops answering costs the lock by its validity deadline, not a hang."""

    async def scenario(client):
        event, kwargs = lost_event({"timeout": 1, "auto_renew": True})
        lock = Lock(client, "hung", **kwargs)
        assert await lock.acquire(blocking=False)
        redis_server.pause()
        try:
            started = time.monotonic()
            await asyncio.wait_for(event.wait(), 4)
            # Validity (1 s) plus at most one bounded renewal attempt in flight.
            assert time.monotonic() - started < 1 + 1.0 + 0.5
            assert "validity" in lock.lease.loss_reason
        finally:
            redis_server.resume()
        again = Lock(client, "hung2", timeout=0.6, auto_renew=True)
        assert await again.acquire(blocking=False)
        await asyncio.sleep(1.5)
        assert await again.owned() and not again.lost
        await again.release()

    arun(scenario, socket_timeout=5)


def test_renewal_survives_script_flush(arun):
    """After SCRIPT FLUSH the renewal reloads its script and keeps the lock."""

    async def scenario(client):
        lock = Lock(client, "flushed", timeout=0.6, auto_renew=True)
        assert await lock.acquire(blocking=False)
        await client.script_flush()
        await asyncio.sleep(1.5)
        assert await lock.owned() and not lock.lost
        await lock.release()

    arun(scenario)


def test_released_lock_is_not_reported_lost(arun, caplog):
    """Releasing while a renewal is due never raises a false loss."""

    async def scenario(client):
        for _ in range(50):
            lock = Lock(client, "brief", timeout=0.1, auto_renew=True)
            assert await lock.acquire(blocking=False)
            await asyncio.sleep(0.03)
            await lock.release()
            assert not lock.lost
        await asyncio.sleep(0.2)

    arun(scenario)
    assert "lost" not in caplog.text


def test_garbage_collected_lock_is_left_to_expire(arun, caplog):
    """A lock object dropped while held stops being renewed, so the key expires."""

    async def scenario(client):
        lock = Lock(client, "orphan", timeout=0.6, auto_renew=True)
        assert await lock.acquire(blocking=False)
        del lock
        gc.collect()
        with caplog.at_level(logging.WARNING):
            await asyncio.sleep(1.2)
        assert await client.get("orphan") is None

    arun(scenario)
    assert "garbage-collected while held" in caplog.text
