"""Acquires in line (``place=``): the oldest waiter of a key is admitted first, on a real server."""

from __future__ import annotations

import time

import pytest
import redis

from celery_redlock import Lock, Semaphore
from celery_redlock.core.lock_options import fence_key_for
from celery_redlock.core.queue_scripts import FAIR_ACQUIRE, Place, queue_keys

pytestmark = pytest.mark.integration


def place(member: str, arrival: int | None = None, near: int = 5000, far: int = 60000) -> Place:
    return Place(member, arrival, near, far)


def lock(r: redis.Redis, name: str = "q:{a}") -> Lock:
    return Lock(r, name, timeout=5, blocking=False)


def test_free_key_with_nobody_in_line_is_taken_and_leaves_nothing(r: redis.Redis) -> None:
    """With nobody waiting the lock is taken at once and no wait list key is written."""
    first = lock(r)
    assert first.acquire(token="t1", place=place("c1"))
    assert first.fence is not None
    assert not any(r.exists(key) for key in queue_keys("q:{a}"))


def test_oldest_waiter_goes_first_and_newcomers_queue_behind(r: redis.Redis) -> None:
    """A free key goes to the head of the line: a newer caller is refused (ranked behind),
    even with the key free, until the head took its turn."""
    holder = lock(r)
    assert holder.acquire(token="h", place=place("h"))
    old, new = lock(r), lock(r)
    assert not old.acquire(token="o", place=place("old"))
    assert old.refusal.rank == 0 and old.refusal.holder_id == "h"
    arrival = old.refusal.arrival_us
    assert arrival is not None
    assert not new.acquire(token="n", place=place("new"))
    assert new.refusal.rank == 1 and new.refusal.waiting == 2
    holder.release()
    # The key is free, but "old" is next: "new" is refused without a holder.
    assert not new.acquire(token="n2", place=place("new"))
    assert new.refusal.rank == 1 and new.refusal.value is None
    # "old" comes back (a requeue carries its arrival) and is admitted.
    assert old.acquire(token="o2", place=place("old", arrival))
    old.release()
    assert new.acquire(token="n3", place=place("new"))
    assert not any(r.exists(key) for key in queue_keys("q:{a}"))


def test_an_older_arrival_moves_a_waiter_forward(r: redis.Redis) -> None:
    """A requeued call whose entry lapsed (or who met its own dead run) takes back its place
    by the arrival it carries."""
    holder = lock(r)
    assert holder.acquire(token="h", place=place("h"))
    a, b = lock(r), lock(r)
    assert not a.acquire(token="a", place=place("a"))
    assert not b.acquire(token="b", place=place("b", arrival=1))
    assert b.refusal.rank == 0
    assert not a.acquire(token="a", place=place("a"))
    assert a.refusal.rank == 1


def test_a_waiter_that_is_not_back_in_time_does_not_hold_the_key(r: redis.Redis) -> None:
    """A waiter counts as present for its near ms after an attempt: past that, a free key
    goes to the next present caller, and the absent one keeps its place for its return."""
    holder = lock(r)
    assert holder.acquire(token="h", place=place("h"))
    asleep = lock(r)
    assert not asleep.acquire(token="s", place=place("asleep", near=200))
    arrival = asleep.refusal.arrival_us
    holder.release()
    late = lock(r)
    assert not late.acquire(token="l", place=place("late"))
    assert late.refusal.rank == 1
    time.sleep(0.3)
    assert late.acquire(token="l", place=place("late"))
    late.release()
    # Back, it is still first in line: a newer caller that is present waits behind it.
    blocker = lock(r)
    assert blocker.acquire(token="b", place=place("b"))
    assert not asleep.acquire(token="s2", place=place("asleep", arrival))
    assert asleep.refusal.rank == 0


def test_a_waiter_gone_for_good_is_pruned(r: redis.Redis) -> None:
    """An entry not renewed within its far ms leaves the line."""
    holder = lock(r)
    assert holder.acquire(token="h", place=place("h"))
    gone = lock(r)
    assert not gone.acquire(token="g", place=place("gone", near=100, far=200))
    time.sleep(0.3)
    other = lock(r)
    assert not other.acquire(token="o", place=place("other"))
    assert other.refusal.rank == 0 and other.refusal.waiting == 1


def test_plain_acquire_ignores_the_line(r: redis.Redis) -> None:
    """Only acquires in line keep the order; a plain acquire is the unchanged script."""
    holder = lock(r)
    assert holder.acquire(token="h", place=place("h"))
    waiter = lock(r)
    assert not waiter.acquire(token="w", place=place("w"))
    holder.release()
    assert lock(r).acquire(token="x")


def test_semaphore_admits_the_first_limit_waiters_in_arrival_order(r: redis.Redis) -> None:
    """With N permits, the first N - held waiters in line are admitted; the rest wait,
    and the line is kept by the call's id across tokens."""
    name = "q:{s}"
    holders = [Semaphore(r, name, limit=2, timeout=5, blocking=False) for _ in range(2)]
    for i, sem in enumerate(holders):
        assert sem.acquire(token=f"h{i}", place=place(f"h{i}"))
    waiters = [Semaphore(r, name, limit=2, timeout=5, blocking=False) for _ in range(3)]
    for i, sem in enumerate(waiters):
        assert not sem.acquire(token=f"w{i}", place=place(f"w{i}"))
        assert sem.refusal.rank == i
    holders[0].release()
    # One permit free: only the head (w0) may take it, whatever its new token.
    assert not waiters[2].acquire(token="w2b", place=place("w2"))
    assert not waiters[1].acquire(token="w1b", place=place("w1"))
    assert waiters[0].acquire(token="w0b", place=place("w0"))
    assert waiters[1].refusal.rank == 1
    holders[1].release()
    assert not waiters[2].acquire(token="w2c", place=place("w2"))
    assert waiters[1].acquire(token="w1c", place=place("w1"))


def _resend(
    r: redis.Redis, name: str, token: str, member: str, arrival: int | None = None
) -> object:
    """FAIR_ACQUIRE sent as a resend (ARGV[4] "1") after a reply that never came."""
    keys = (name, fence_key_for(name), *queue_keys(name))
    args = FAIR_ACQUIRE.resend((token, 5000, 60000, "0", "0", *place(member, arrival).args()))
    return FAIR_ACQUIRE(r, keys, args)


def test_a_resend_does_not_jump_the_line(r: redis.Redis) -> None:
    """A resend whose first send never ran (or was refused) takes a free key only in its
    turn: an older present waiter is still next, and a waiter admitted by a resend leaves
    the line."""
    name = "q:{resend}"
    holder = lock(r, name)
    assert holder.acquire(token="h", place=place("h"))
    old = lock(r, name)
    assert not old.acquire(token="o", place=place("old"))
    arrival = old.refusal.arrival_us
    holder.release()
    assert isinstance(_resend(r, name, "n", "new"), list)
    assert r.get(name) is None
    assert isinstance(_resend(r, name, "o2", "old", arrival), int)
    assert r.get(name) == b"o2"
    assert r.zscore(queue_keys(name)[0], "old") is None
    # The first send took it and its reply was lost: the resend finds it ours.
    assert isinstance(_resend(r, name, "o2", "old", arrival), int)


def test_a_bytes_name_makes_its_usual_attempt(r: redis.Redis) -> None:
    """A lock named by bytes (which redis-py accepts) is not queued, but does not fail."""
    name = b"q:{bytes}"
    first = Lock(r, name, timeout=5, blocking=False)
    assert first.acquire(token="t1", place=place("c1"))
    second = Lock(r, name, timeout=5, blocking=False)
    assert not second.acquire(token="t2", place=place("c2"))
    first.release()
    assert second.acquire(token="t3", place=place("c2"))


def test_a_semaphore_waiter_that_is_not_back_in_time_does_not_hold_a_permit(
    r: redis.Redis,
) -> None:
    """As for a lock: a free permit waits only for the present waiters ahead; an absent
    one keeps its place for its return."""
    name = "q:{sabsent}"

    def sem() -> Semaphore:
        return Semaphore(r, name, limit=1, timeout=5, blocking=False)

    holder = sem()
    assert holder.acquire(token="h", place=place("h"))
    asleep = sem()
    assert not asleep.acquire(token="s", place=place("asleep", near=200))
    arrival = asleep.refusal.arrival_us
    holder.release()
    late = sem()
    assert not late.acquire(token="l", place=place("late"))
    assert late.refusal.rank == 1
    time.sleep(0.3)
    assert late.acquire(token="l2", place=place("late"))
    late.release()
    blocker = sem()
    assert blocker.acquire(token="b", place=place("b"))
    assert not asleep.acquire(token="s2", place=place("asleep", arrival))
    assert asleep.refusal.rank == 0


def test_a_blocking_semaphore_acquire_in_line_that_times_out_leaves_the_line(
    r: redis.Redis,
) -> None:
    """The entry of a place is the call's member, not its token: a timeout removes it."""
    name = "q:{stimeout}"
    holder = Semaphore(r, name, limit=1, timeout=5, blocking=False)
    assert holder.acquire(token="h")
    waiter = Semaphore(r, name, limit=1, timeout=5)
    assert not waiter.acquire(token="w", place=place("call-1"), blocking_timeout=0.05)
    assert not any(r.zscore(key, "call-1") for key in queue_keys(name))
