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


async def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` seconds.

    The timeouts are windows far longer than the waits they bound, for a
    loaded machine: a test asserts what happened, never how fast.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


def test_auto_renewed_lock_outlives_its_ttl_many_times(arun):
    """A 1 s lock renewed 7 times (held 2.3 s or more) is still ours, and never reported lost."""

    async def scenario(client):
        lock = Lock(client, "long", timeout=1, auto_renew=True)
        assert await lock.acquire(blocking=False)
        await wait_until(lambda: lock.lease.renewals >= 7 or lock.lost, 20, "7 renewals")
        assert await lock.owned()
        assert not lock.lost
        assert 0 < lock.remaining() <= 1
        await lock.release()
        assert await client.get("long") is None

    arun(scenario)


@pytest.mark.parametrize("tamper", ["delete", "overwrite"])
def test_lock_taken_away_is_reported_lost_within_one_renewal_period(arun, redis_server, tamper):
    """Deleting or overwriting the key behind the holder's back is noticed at the next renewal."""

    async def scenario(client):
        event, kwargs = lost_event({"timeout": 1.5, "auto_renew": True})
        lock = Lock(client, "victim", **kwargs)
        assert await lock.acquire(blocking=False)
        if tamper == "delete":
            await client.delete("victim")
        else:
            await client.set("victim", "intruder", px=10_000)
        renewals = lock.lease.renewals
        redis_server.reset_stats()
        await asyncio.wait_for(event.wait(), 10)
        # The first renewal sent after the tampering reported the loss: no renewal
        # succeeded meanwhile, and the server ran at most one (one that ran before
        # the reset counts neither here nor there).
        assert lock.lease.renewals == renewals
        assert redis_server.commandstats().get("evalsha", 0) <= 1
        assert lock.lost
        assert lock.lease.loss_reason == "the key no longer holds this lease's token"
        if tamper == "overwrite":
            assert await client.get("victim") == b"intruder"

    arun(scenario)


def test_hung_server_marks_the_lock_lost_by_its_deadline(arun, redis_server):
    """A server that stops answering costs the lock by its validity deadline, not a hang."""

    async def scenario(client):
        past_deadline: list[bool] = []

        def lost(lease):
            past_deadline.append(lease.deadline <= time.monotonic())

        lock = Lock(client, "hung", timeout=1, auto_renew=True, on_lost=lost)
        assert await lock.acquire(blocking=False)
        redis_server.pause()
        try:
            # A window far past the 1 s validity plus one bounded renewal
            # attempt, while the server stays hung throughout.
            await wait_until(lambda: past_deadline, 20, "the loss of the lock")
            assert "validity" in lock.lease.loss_reason
        finally:
            redis_server.resume()
        assert past_deadline == [True]  # given up when its validity ran out, not before
        again = Lock(client, "hung2", timeout=0.6, auto_renew=True)
        assert await again.acquire(blocking=False)
        await wait_until(lambda: again.lease.renewals >= 3 or again.lost, 20, "3 renewals")
        assert await again.owned() and not again.lost
        await again.release()

    # No socket timeout: a renewal that waited on the client would hang as
    # long as the server does.
    arun(scenario, socket_timeout=None)


def test_renewal_survives_script_flush(arun):
    """After SCRIPT FLUSH the renewal reloads its script and keeps the lock."""

    async def scenario(client):
        lock = Lock(client, "flushed", timeout=0.6, auto_renew=True)
        assert await lock.acquire(blocking=False)
        await client.script_flush()
        renewals = lock.lease.renewals
        await wait_until(lambda: lock.lease.renewals >= renewals + 2 or lock.lost, 20, "renewals")
        assert await lock.owned() and not lock.lost
        await lock.release()

    arun(scenario)


def test_released_lock_is_not_reported_lost(arun, caplog):
    """Releasing while a renewal is due never raises a false loss."""

    losses: list[str] = []

    async def scenario(client):
        for _ in range(50):
            lock = Lock(
                client,
                "brief",
                timeout=0.1,
                auto_renew=True,
                on_lost=lambda lease: losses.append(lease.name),
            )
            assert await lock.acquire(blocking=False)
            await asyncio.sleep(0.03)
            await lock.release()
            assert not lock.lost
        # The loop fires timers in order: two renewals of a probe come after
        # every renewal the released leases would have been due for.
        probe = Lock(client, "probe", timeout=0.3, auto_renew=True)
        assert await probe.acquire(blocking=False)
        await wait_until(lambda: probe.lease.renewals >= 2, 20, "2 renewals of the probe")
        await probe.release()

    arun(scenario)
    assert losses == []
    assert "lost" not in caplog.text


def test_garbage_collected_lock_is_left_to_expire(arun, caplog):
    """A lock object dropped while held stops being renewed, so the key expires."""

    async def scenario(client):
        lock = Lock(client, "orphan", timeout=0.6, auto_renew=True)
        assert await lock.acquire(blocking=False)
        del lock
        gc.collect()
        with caplog.at_level(logging.WARNING):
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline and await client.exists("orphan"):
                await asyncio.sleep(0.05)
        assert await client.get("orphan") is None

    arun(scenario)
    assert "garbage-collected while held" in caplog.text
