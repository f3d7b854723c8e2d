"""The lock and the semaphore, sync and asyncio, word their errors and log lines as they always did.

Their texts are composed in one place (``core/hold.py``); these tests pin each
class's words, letter for letter, with no Redis: every error checked here is
raised before any round trip.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis
import redis.asyncio

import celery_redlock
import celery_redlock.asyncio
from celery_redlock.core.exceptions import LockError, LockNotAcquired, LockNotOwned
from celery_redlock.core.hold import LOCK, PERMIT, check_renewable, lock_not_acquired
from celery_redlock.core.lease import Lease


def _lease() -> Lease:
    return Lease(client=None, name="k", token=b"t", fence=1, ttl=10.0, sent_at=0.0, clock=float)


@pytest.mark.parametrize(
    ("wording", "renewal", "release"),
    [
        (
            LOCK,
            ("Cannot extend a lock that's no longer owned", "not owned at extend"),
            ("Cannot release a lock that's no longer owned", "not owned at release"),
        ),
        (
            PERMIT,
            ("Cannot extend a permit that's no longer held", "not held at extend"),
            ("Cannot release a permit that's no longer held", "not held at release"),
        ),
    ],
)
def test_a_hold_found_gone_marks_its_lease_and_says_so(wording, renewal, release):
    """lost() at a renewal, lost_at_release() at a release (with or without a lease)."""
    for found_by, (message, reason) in (("renewal", renewal), ("release", release)):
        lease = _lease()
        if found_by == "renewal":
            error = wording.lost(lease, "extend", "k")
        else:
            lease.released = True  # as release() leaves it, its callback dropped
            error = wording.lost_at_release(lease, "k")
        assert isinstance(error, LockNotOwned)
        assert (str(error), error.lock_name) == (message, "k")
        assert (lease.lost, lease.loss_reason) == (True, reason)
    assert str(wording.lost_at_release(None, "k")) == release[0]


def test_a_lock_not_taken_in_a_with_block_names_its_holder():
    """lock_not_acquired(): the message redis-py's lock uses, the holder and its TTL if known."""
    error = lock_not_acquired("k", ("holder", 1.5))
    assert isinstance(error, LockNotAcquired)
    assert str(error) == "Unable to acquire lock within the time specified"
    assert (error.lock_name, error.holder, error.holder_ttl) == ("k", "holder", 1.5)
    unknown = lock_not_acquired("k", None)
    assert isinstance(unknown, LockNotAcquired)
    assert (unknown.holder, unknown.holder_ttl) == (None, None)


def test_extend_and_reacquire_refuse_an_unheld_or_unexpiring_lock():
    """check_renewable(): not held first, then no timeout; a held, expiring lock passes."""
    with pytest.raises(LockError, match=r"^Cannot extend an unlocked lock$"):
        check_renewable("k", None, 10.0, "extend")
    with pytest.raises(LockError, match=r"^Cannot reacquire a lock with no timeout$"):
        check_renewable("k", b"t", None, "reacquire")
    check_renewable("k", b"t", 10.0, "extend")


def _locks() -> list[tuple[object, str]]:
    client, aclient = redis.Redis(), redis.asyncio.Redis()
    unheld_lock = "Cannot release a lock that's not owned or is already unlocked."
    unheld_permit = "Cannot release a permit that's not held."
    return [
        (celery_redlock.Lock(client, "k", raise_on_release_error=False), unheld_lock),
        (celery_redlock.asyncio.Lock(aclient, "k", raise_on_release_error=False), unheld_lock),
        (
            celery_redlock.Semaphore(
                client, "k", limit=2, timeout=10, raise_on_release_error=False
            ),
            unheld_permit,
        ),
        (
            celery_redlock.asyncio.Semaphore(
                aclient, "k", limit=2, timeout=10, raise_on_release_error=False
            ),
            unheld_permit,
        ),
    ]


@pytest.mark.parametrize("index", range(4), ids=["Lock", "aLock", "Semaphore", "aSemaphore"])
def test_each_class_words_a_release_without_a_hold_and_the_with_block_it_ends(index, caplog):
    """release() unheld: each class's message; leaving a with block logs it in its words."""
    lock, unheld = _locks()[index]
    is_async = type(lock).__module__.startswith("celery_redlock.asyncio")

    async def run(coroutine):  # the asyncio classes look their task's state up on a loop
        return await coroutine

    with pytest.raises(LockError) as raised:
        if is_async:
            asyncio.run(run(lock.release()))
        else:
            lock.release()
    assert str(raised.value) == unheld
    caplog.set_level(logging.WARNING)
    if is_async:
        asyncio.run(lock.__aexit__(None, None, None))
    else:
        lock.__exit__(None, None, None)
    semaphore = "Semaphore" in type(lock).__name__
    block = "async with" if is_async else "with"
    subject = "permit of k" if semaphore else "lock k"
    (record,) = caplog.records
    assert record.getMessage() == f"{subject} was lost before the {block} block ended"
    assert record.name == type(lock).__module__
