"""The asyncio semaphore on a real redis-server: N permits, per-task state, cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from celery_redlock import LockError, LockNotOwned
from celery_redlock.asyncio import Semaphore
from celery_redlock.core.holder import Holder
from celery_redlock.core.semaphore_scripts import semaphore_keys

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("decode", [False, True])
def test_tasks_on_one_loop_share_up_to_limit_permits(arun: Any, decode: bool) -> None:
    """Eight tasks of one loop on a 3-permit semaphore: never more than 3 inside, every task
    gets in (blocking acquires, first come first served), fences all distinct."""
    inside: list[int] = []
    most = 0
    fences: list[int] = []

    async def scenario(client: Any) -> None:
        semaphore = Semaphore(client, "sem", limit=3, timeout=5, sleep=0.02, blocking_timeout=20)

        async def worker() -> None:
            nonlocal most
            assert await semaphore.acquire()
            inside.append(1)
            most = max(most, len(inside))
            fences.append(semaphore.fence)
            assert semaphore.slot in (0, 1, 2)
            await asyncio.sleep(0.05)
            inside.pop()
            await semaphore.release()

        await asyncio.gather(*(worker() for _ in range(8)))

    arun(scenario, decode_responses=decode)
    assert most == 3
    assert len(fences) == len(set(fences)) == 8


def test_refusal_and_release_by_permit_only(arun: Any) -> None:
    """The fourth acquire is refused with the permit that frees first; a permit removed
    behind its holder's back makes its release fail without touching the others."""

    async def scenario(client: Any) -> None:
        holders = [Semaphore(client, "sem", limit=3, timeout=5, blocking=False) for _ in range(4)]
        assert [await s.acquire() for s in holders] == [True, True, True, False]
        refusal = holders[3].refusal
        assert (refusal.held, refusal.limit) == (3, 3) and refusal.ttl is not None
        await client.zrem(semaphore_keys("sem").permits, holders[0].token)
        with pytest.raises(LockNotOwned):
            await holders[0].release()
        assert await client.zcard(semaphore_keys("sem").permits) == 2
        assert await holders[3].acquire()
        assert await holders[3].held() == 3

    arun(scenario)


def test_a_task_never_holds_two_permits(arun: Any) -> None:
    """As in the sync semaphore: a second permit for the same task id is refused."""

    async def scenario(client: Any) -> None:
        first, again = (Semaphore(client, "sem", limit=3, timeout=5, blocking=False) for _ in "ab")
        assert await first.acquire(token=Holder.new("t-1").encode())
        assert not await again.acquire(token=Holder.new("t-1").encode())
        assert again.refusal.holder_id == "t-1"

    arun(scenario)


def test_auto_renewal_keeps_a_permit_past_its_ttl(arun: Any) -> None:
    """A renewed permit outlives several TTLs; the renewal task renews the permit, not a key."""

    async def scenario(client: Any) -> None:
        holder = Semaphore(client, "sem", limit=2, timeout=0.3, auto_renew=True, blocking=False)
        other = Semaphore(client, "sem", limit=2, timeout=5, blocking=False)
        assert await holder.acquire()
        while holder.lease.renewals < 4:
            await asyncio.sleep(0.05)
        assert not holder.lost
        assert await holder.owned()
        assert await other.acquire() and other.slot == 1
        await holder.release()

    arun(scenario)


def test_a_cancelled_blocking_acquire_leaves_nothing_behind(arun: Any) -> None:
    """Cancelled while it waits, or timed out: it holds no permit and leaves the wait list."""

    async def scenario(client: Any) -> None:
        keys = semaphore_keys("sem")
        holder = Semaphore(client, "sem", limit=1, timeout=5, blocking=False)
        waiter = Semaphore(client, "sem", limit=1, timeout=5, sleep=0.05)
        assert await holder.acquire()
        attempt = asyncio.ensure_future(waiter.acquire())
        while not await client.zcard(keys.waiters):
            await asyncio.sleep(0.01)
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        assert await client.zcard(keys.permits) == 1
        while await client.zcard(keys.waiters):  # the cancelled waiter's leave runs on
            await asyncio.sleep(0.01)
        assert not await waiter.acquire(blocking_timeout=0.2)
        assert await client.zcard(keys.waiters) == 0

    arun(scenario)


def test_one_task_never_holds_two_permits(arun: Any) -> None:
    """Two acquires one task makes at once (``gather``) share its hold: one takes a permit,
    the other gives back the permit it was granted and raises LockError; a later acquire
    while the permit is held raises at once. One permit is held, and the release frees it."""

    async def scenario(client: Any) -> None:
        semaphore = Semaphore(client, "sem", limit=3, timeout=5, blocking=False)
        outcomes = await asyncio.gather(
            semaphore.acquire(), semaphore.acquire(), return_exceptions=True
        )
        assert outcomes.count(True) == 1, outcomes
        (refused,) = [outcome for outcome in outcomes if outcome is not True]
        assert isinstance(refused, LockError) and "already holds a permit" in str(refused)
        assert await semaphore.held() == 1
        with pytest.raises(LockError, match="already holds a permit"):
            await semaphore.acquire()
        await semaphore.release()
        assert await semaphore.held() == 0

    arun(scenario)


def test_a_cancellation_during_the_give_back_is_not_turned_into_a_lock_error(arun: Any) -> None:
    """A task cancelled while it gives back a second permit raises CancelledError, not the
    LockError: ``asyncio.timeout`` and task groups go by the cancellation, and the permit is
    given back all the same."""

    async def scenario(client: Any) -> None:
        semaphore = Semaphore(client, "sem", limit=3, timeout=5, blocking=False)
        check = semaphore._one_permit_each
        giving_back = asyncio.Event()
        go_on = asyncio.Event()
        send_release = semaphore._send_release

        async def slow_release(member: bytes) -> bool:
            giving_back.set()
            await go_on.wait()
            return await send_release(member)

        async def twice() -> None:
            assert await semaphore.acquire()
            calls = []

            def first_check_passes(hold: Any) -> None:
                calls.append(1)
                if len(calls) > 1:
                    check(hold)

            semaphore._one_permit_each = first_check_passes  # type: ignore[method-assign]
            semaphore._send_release = slow_release  # type: ignore[method-assign]
            try:
                await semaphore.acquire()
            finally:
                semaphore._one_permit_each = check  # type: ignore[method-assign]
                semaphore._send_release = send_release  # type: ignore[method-assign]
                await semaphore.release()

        task = asyncio.ensure_future(twice())
        await giving_back.wait()
        task.cancel()
        await asyncio.sleep(0.01)
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await semaphore.held() == 0

    arun(scenario)
