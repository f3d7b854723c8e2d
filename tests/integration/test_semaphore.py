"""The semaphore on a real redis-server: N permits, each its own token, lease and fence.

Every test runs its own server (the ``r`` fixture). Time passes for real only
where a permit must expire on the server's clock, and then the test waits for
the server to say so, never for a fixed time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_redlock import Lock, LockError, LockNotOwned, Semaphore
from celery_redlock.core.holder import Holder
from celery_redlock.core.lock_options import fence_key_for
from celery_redlock.core.renewal import Watchdog
from celery_redlock.core.semaphore_scripts import ACQUIRE_PERMIT, semaphore_keys
from tests.celery_harness import wait_until
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NeverStarted:
    """Stands in for the watchdog's thread: the test drives passes with ``renew_due()``."""

    def is_alive(self) -> bool:
        return True


def manual_watchdog(clock: FakeClock) -> Watchdog:
    """A watchdog on ``clock`` that never starts its thread."""
    watchdog = Watchdog(clock=clock)
    watchdog._thread = NeverStarted()  # type: ignore[assignment]
    return watchdog


def semaphores(r: redis.Redis, count: int, name: str = "sem", **kwargs: Any) -> list[Semaphore]:
    """``count`` contenders of one semaphore, each its own object, sharing nothing locally."""
    kwargs.setdefault("limit", 3)
    kwargs.setdefault("timeout", 10)
    kwargs.setdefault("blocking", False)
    return [Semaphore(r, name, **kwargs) for _ in range(count)]


def test_up_to_limit_holders_then_the_refusal_says_who_frees_first(r: redis.Redis) -> None:
    """Three permits go to three holders, each in its own slot; the fourth is refused with
    the permit that frees first, how full the semaphore is and its time left."""
    contenders = semaphores(r, 4)
    assert [s.acquire() for s in contenders] == [True, True, True, False]
    assert sorted(s.slot for s in contenders[:3]) == [0, 1, 2]
    refusal = contenders[3].refusal
    assert (refusal.held, refusal.limit, refusal.waiting) == (3, 3, 0)
    holders = {s.lease.token.split(b"|", 2)[2].decode() for s in contenders[:3]}
    assert refusal.value in holders
    assert refusal.ttl is not None and 0 < refusal.ttl <= 10
    assert "one of 3/3 permit holders" in refusal.describe()
    assert contenders[0].locked() and contenders[0].held() == 3


def test_fences_rise_across_permits_and_a_lock_of_the_same_name(r: redis.Redis) -> None:
    """Every permit draws from the name's fence counter, the one a Lock of that name uses."""
    first, second = semaphores(r, 2)
    assert first.acquire() and second.acquire()
    assert first.fence < second.fence
    first.release()
    assert first.acquire()
    assert first.fence > second.fence
    last = first.fence
    first.release()
    second.release()
    lock = Lock(r, "sem", timeout=10)
    assert lock.acquire(blocking=False)
    assert lock.fence > last
    assert int(r.get(fence_key_for("sem"))) == lock.fence


def test_release_is_by_permit_token_only(r: redis.Redis) -> None:
    """A holder whose permit is gone gets LockNotOwned and removes nobody else's permit."""
    first, second, third = semaphores(r, 3)
    assert first.acquire() and second.acquire() and third.acquire()
    keys = semaphore_keys("sem")
    r.zrem(keys.permits, first.token)  # as if it expired and an acquire reclaimed it
    with pytest.raises(LockNotOwned):
        first.release()
    assert first.lease.lost
    assert set(r.zrange(keys.permits, 0, -1)) == {second.token, third.token}
    second.release()
    assert r.zrange(keys.permits, 0, -1) == [third.token]


def test_an_expired_permit_is_reclaimed_by_the_next_acquire(r: redis.Redis) -> None:
    """A holder that stops renewing frees its slot once its TTL runs out on the server:
    the next acquire removes the expired permit in the same script and takes a permit."""
    dead = semaphores(r, 2, limit=2, timeout=0.3)
    assert all(s.acquire() for s in dead)
    (late,) = semaphores(r, 1, limit=2, timeout=10)
    assert not late.acquire()
    wait_until(lambda: late.held() == 0, 10, message="both permits to expire")
    assert late.acquire()
    assert r.zcard(semaphore_keys("sem").permits) == 1
    assert late.slot == 0
    assert late.fence > max(s.lease.fence for s in dead)


def test_watchdog_renews_permits_and_locks_with_one_call_per_script(
    redis_server: RedisServer,
) -> None:
    """Permits of several semaphores and locks held by one process are renewed in one
    pass: one script call for the locks, one for the permits, pipelined together."""
    r = redis_server.client()
    clock = FakeClock()
    watchdog = manual_watchdog(clock)
    options = {"timeout": 3, "auto_renew": True, "watchdog": watchdog, "clock": clock}
    held: list[Any] = []
    for name in ("a", "b"):
        held += semaphores(r, 2, name, **options)
    held += [Lock(r, name, blocking=False, **options) for name in ("c", "d")]
    for holder in held:
        assert holder.acquire(blocking=False)
    clock.now += 1.0  # a third of the TTL: every lease is due
    watchdog.renew_due()  # warms the renewal client's connection up
    clock.now += 1.0
    redis_server.reset_stats()
    watchdog.renew_due()
    assert redis_server.commandstats().get("evalsha") == 2
    assert all(holder.lease.renewals == 2 for holder in held)
    assert not any(holder.lost for holder in held)


def test_a_permit_removed_behind_its_holders_back_is_reported_lost(r: redis.Redis) -> None:
    """The watchdog finds the permit gone: ``lost`` turns true and ``on_lost`` runs."""
    clock = FakeClock()
    watchdog = manual_watchdog(clock)
    lost: list[Any] = []
    (holder,) = semaphores(
        r, 1, timeout=3, auto_renew=True, watchdog=watchdog, clock=clock, on_lost=lost.append
    )
    assert holder.acquire()
    r.delete(semaphore_keys("sem").permits)
    clock.now += 1.0
    watchdog.renew_due()
    assert holder.lost and lost == [holder.lease]


def test_a_task_never_holds_two_permits(r: redis.Redis) -> None:
    """A token naming a task is refused while another permit names the same task id, even
    with permits free, and the refusal names that permit: a redelivered task waits for
    its first delivery."""
    first, again, other = semaphores(r, 3)
    assert first.acquire(token=Holder.new("task-1").encode())
    assert not again.acquire(token=Holder.new("task-1").encode())
    assert again.refusal.holder_id == "task-1" and again.refusal.held == 1
    assert other.acquire(token=Holder.new("task-2").encode())


def test_an_acquire_sent_again_after_a_lost_reply_finds_its_own_permit(r: redis.Redis) -> None:
    """The resend of an acquire whose first reply was lost gets the same permit, not a second."""
    keys = semaphore_keys("sem")
    args = ["tok", 10_000, 3, 60_000, "", 0]
    first = ACQUIRE_PERMIT(r, (keys.permits, keys.fence, keys.waiters, keys.waiting), [*args, "0"])
    again = ACQUIRE_PERMIT(r, (keys.permits, keys.fence, keys.waiters, keys.waiting), [*args, "1"])
    assert first == again and first[0] == 1
    assert r.zcard(keys.permits) == 1


def test_a_blocking_acquire_that_times_out_leaves_the_wait_list(r: redis.Redis) -> None:
    """A waiter that gives up is off the list, so it holds nobody back."""
    (holder,) = semaphores(r, 1, limit=1)
    (waiter,) = semaphores(r, 1, limit=1, blocking=True, sleep=0.05)
    assert holder.acquire()
    assert not waiter.acquire(blocking_timeout=0.3)
    assert r.zcard(semaphore_keys("sem").waiters) == 0
    assert waiter.refusal.held == 1


@pytest.fixture
def threads() -> Iterator[list[threading.Thread]]:
    """Threads a test starts; joined (bounded) at teardown."""
    started: list[threading.Thread] = []
    yield started
    for thread in started:
        thread.join(timeout=10)


def wait_in_thread(
    threads: list[threading.Thread], waiter: Semaphore, order: list[int], index: int
) -> None:
    def run() -> None:
        if waiter.acquire(blocking_timeout=20):
            order.append(index)
            waiter.release()

    thread = threading.Thread(target=run, daemon=True)
    threads.append(thread)
    thread.start()


def test_waiters_are_admitted_in_arrival_order_and_newcomers_queue_behind(
    r: redis.Redis, threads: list[threading.Thread]
) -> None:
    """No starvation: under steady contention, waiters get the permit first come, first
    served, and a caller that keeps retrying without waiting never overtakes them."""
    keys = semaphore_keys("sem")
    (holder,) = semaphores(r, 1, limit=1, thread_local=False)
    assert holder.acquire()
    order: list[int] = []
    for index in range(3):
        waiter = Semaphore(r, "sem", limit=1, timeout=10, sleep=0.5, thread_local=False)
        wait_in_thread(threads, waiter, order, index)
        queued = index + 1
        wait_until(lambda n=queued: r.zcard(keys.waiters) == n, 10, message="the waiter queued")
    holder.release()
    # The greedy caller retries without waiting; each waiter still gets in first.
    while len(order) < 3:
        if holder.acquire(blocking=False):
            assert len(order) == 3, f"a newcomer overtook waiters; admitted so far: {order}"
            holder.release()
    assert order == [0, 1, 2]


def test_a_release_wakes_a_waiter_without_polling(
    r: redis.Redis, threads: list[threading.Thread]
) -> None:
    """A waiter whose polling interval is far longer than the test's time limit still gets
    the permit: the release pushes to the wake list it blocks on."""
    keys = semaphore_keys("sem")
    (holder,) = semaphores(r, 1, limit=1)
    assert holder.acquire()
    order: list[int] = []
    waiter = Semaphore(r, "sem", limit=1, timeout=10, sleep=60, thread_local=False)
    wait_in_thread(threads, waiter, order, 0)
    wait_until(lambda: r.zcard(keys.waiters) == 1, 10, message="the waiter queued")
    wait_until(lambda: r.info("clients")["blocked_clients"] == 1, 10, message="it blocks")
    holder.release()
    threads[0].join(timeout=20)
    assert order == [0]


@pytest.mark.parametrize("thread_local", [True, False])
def test_a_holder_never_takes_a_second_permit(r: redis.Redis, thread_local: bool) -> None:
    """An acquire on an object that holds a live permit (in this thread, or at all when the
    hold is shared) raises LockError and takes nothing: a second permit would replace the
    first in the hold, where no release reaches it and renewal keeps it for ever."""
    semaphore = Semaphore(r, "sem", limit=3, timeout=10, blocking=False, thread_local=thread_local)
    assert semaphore.acquire()
    first = semaphore.token
    with pytest.raises(LockError, match="already holds a permit"):
        semaphore.acquire()
    assert semaphore.token == first
    assert semaphore.held() == 1
    semaphore.release()
    assert semaphore.held() == 0
    assert semaphore.acquire()  # once released, the object takes a permit again
    semaphore.release()


def test_two_threads_racing_on_a_shared_hold_keep_one_permit(r: redis.Redis) -> None:
    """Two threads acquiring one ``thread_local=False`` semaphore at once, both granted: the
    one that finds the hold filled gives its permit back and raises LockError. Between its
    check and its store each thread waits (up to 1 s) for the other to check too: without the
    check and store made atomic, both stored, the first permit was overwritten in the hold,
    and no release could reach it."""
    semaphore = Semaphore(r, "sem", limit=3, timeout=10, blocking=False, thread_local=False)
    checked = threading.Barrier(2, timeout=1)
    calls = threading.local()
    check = semaphore._one_permit_each

    def check_then_wait(hold: Any) -> None:
        check(hold)
        calls.count = getattr(calls, "count", 0) + 1
        if calls.count == 2:  # the check after the grant
            # Broken when the other thread cannot check before this one stored.
            with contextlib.suppress(threading.BrokenBarrierError):
                checked.wait()

    semaphore._one_permit_each = check_then_wait  # type: ignore[method-assign]
    outcomes: list[Any] = []

    def contender() -> None:
        try:
            outcomes.append(semaphore.acquire())
        except LockError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=contender) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert outcomes.count(True) == 1, outcomes
    assert semaphore.held() == 1
    semaphore.release()
    assert semaphore.held() == 0


def test_a_give_back_that_fails_still_raises_the_lock_error(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A permit granted to a holder that holds one already is given back; when that fails
    (Redis gone meanwhile), the caller still gets the LockError it is owed, not the connection
    error, and a warning says the permit expires with its TTL."""
    semaphore = Semaphore(r, "sem", limit=3, timeout=10, blocking=False, thread_local=False)
    assert semaphore.acquire()
    first = semaphore.token
    # The hold looks empty at the first check only, as if another thread had not stored yet.
    check = semaphore._one_permit_each
    calls = []

    def first_check_passes(hold: Any) -> None:
        calls.append(1)
        if len(calls) > 1:
            check(hold)

    def release_fails(*args: Any, **kwargs: Any) -> None:
        raise redis.ConnectionError("gone")

    semaphore._one_permit_each = first_check_passes  # type: ignore[method-assign]
    monkeypatch.setattr("celery_redlock.core.semaphore.RELEASE_PERMIT", release_fails)
    # The logger's own level: an in-process Celery worker of an earlier test
    # may have left the root logger above WARNING.
    with (
        caplog.at_level(logging.WARNING, logger="celery_redlock"),
        pytest.raises(LockError, match="already holds a permit"),
    ):
        semaphore.acquire()
    monkeypatch.undo()
    assert semaphore.token == first
    assert "could not be given back" in caplog.text
    semaphore.release()
    assert semaphore.held() == 1  # the second permit, left to its TTL
