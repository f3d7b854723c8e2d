"""celery_redlock.asyncio.Lock behaves like redis-py's asyncio Lock wherever both define behaviour.

The asyncio mirror of tests/integration/test_lock_compat.py: every test runs
against ``redis.asyncio.lock.Lock`` (the reference) and
``celery_redlock.asyncio.Lock``, created through ``client.lock(name, lock_class=...)``.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio.lock
from redis.exceptions import LockError, LockNotOwnedError

import celery_redlock.asyncio


@pytest.fixture(
    params=[redis.asyncio.lock.Lock, celery_redlock.asyncio.Lock],
    ids=["redis-py", "celery-redlock"],
)
def lock_class(request):
    return request.param


@pytest.fixture(params=[False, True], ids=["bytes", "decoded"])
def decode(request):
    return request.param


def make(client, lock_class, name="foo", **kwargs):
    return client.lock(name, lock_class=lock_class, **kwargs)


def as_bytes(value):
    return value.encode() if isinstance(value, str) else value


def test_acquire_stores_the_token_without_expiry(arun, lock_class, decode):
    """A lock without timeout stores its token under the name and never expires."""

    async def scenario(client):
        lock = make(client, lock_class)
        assert await lock.acquire(blocking=False)
        assert as_bytes(await client.get("foo")) == lock.local.token
        assert await client.ttl("foo") == -1
        await lock.release()
        assert await client.get("foo") is None

    arun(scenario, decode_responses=decode)


def test_given_token_is_stored_encoded(arun, lock_class, decode):
    """acquire(token=...) stores exactly that token and clears it on release."""

    async def scenario(client):
        lock = make(client, lock_class)
        assert await lock.acquire(blocking=False, token="test")
        assert as_bytes(await client.get("foo")) == b"test"
        assert lock.local.token == b"test"
        await lock.release()
        assert lock.local.token is None

    arun(scenario, decode_responses=decode)


def test_locked_and_owned_track_the_holder(arun, lock_class, decode):
    """locked() sees any holder; owned() only our own hold."""

    async def scenario(client):
        first, second = make(client, lock_class), make(client, lock_class)
        assert not await first.locked()
        assert await first.acquire(blocking=False)
        assert await first.locked() and await second.locked()
        assert await first.owned() and not await second.owned()
        await first.release()
        assert not await first.locked() and not await first.owned()

    arun(scenario, decode_responses=decode)


def test_competing_locks_exclude_each_other(arun, lock_class, decode):
    """Two instances on one name never hold it together."""

    async def scenario(client):
        first, second = make(client, lock_class), make(client, lock_class)
        assert await first.acquire(blocking=False)
        assert not await second.acquire(blocking=False)
        await first.release()
        assert await second.acquire(blocking=False)
        assert not await first.acquire(blocking=False)
        await second.release()

    arun(scenario, decode_responses=decode)


@pytest.mark.parametrize(("timeout", "low", "high"), [(10, 8000, 10000), (9.5, 8000, 9500)])
def test_timeout_sets_the_key_expiry(arun, lock_class, timeout, low, high):
    """The key expires after the lock's timeout, integer or float."""

    async def scenario(client):
        lock = make(client, lock_class, timeout=timeout)
        assert await lock.acquire(blocking=False)
        assert low < await client.pttl("foo") <= high
        await lock.release()

    arun(scenario)


def test_blocking_timeout_gives_up_in_time(arun, lock_class, redis_server):
    """A blocked acquire tries again every sleep, and returns False by blocking_timeout."""

    async def scenario(client):
        holder = make(client, lock_class)
        assert await holder.acquire(blocking=False)
        waiter = make(client, lock_class, blocking_timeout=1.0, sleep=0.05)
        redis_server.reset_stats()
        assert not await waiter.acquire()
        calls = redis_server.commandstats()
        # A script's own SET is counted too: scripts first, else SET NX.
        attempts = calls.get("evalsha", 0) + calls.get("eval", 0) or calls.get("set", 0)
        # Each retry follows a 0.05 s sleep, so no more than 1 + 1.0 / 0.05
        # attempts fit into the blocking timeout, however slow the machine; at
        # least one retry does unless the first round trip alone took 0.95 s.
        assert 2 <= attempts <= 21
        await holder.release()

    arun(scenario)


def test_blocking_acquire_waits_for_release(arun, lock_class):
    """A blocked acquire succeeds once the holder (another task) releases."""

    async def scenario(client):
        holder = make(client, lock_class, thread_local=False)
        assert await holder.acquire(blocking=False)

        async def release_later():
            await asyncio.sleep(0.2)
            await holder.release()

        releaser = asyncio.ensure_future(release_later())
        waiter = make(client, lock_class, sleep=0.01, blocking_timeout=5)
        assert await waiter.acquire()
        await waiter.release()
        await releaser

    arun(scenario)


def test_context_manager_releases(arun, lock_class):
    """Leaving the async with block releases the lock."""

    async def scenario(client):
        async with make(client, lock_class, blocking_timeout=0.2) as lock:
            assert await client.get("foo") == lock.local.token
        assert await client.get("foo") is None

    arun(scenario)


def test_context_manager_raises_when_not_acquired(arun, lock_class):
    """Entering an async with block on a held lock raises LockError after blocking_timeout."""

    async def scenario(client):
        await client.set("foo", "bar")
        with pytest.raises(LockError):
            async with make(client, lock_class, blocking_timeout=0.1):
                pass

    arun(scenario)


def test_releasing_an_unheld_lock_raises(arun, lock_class):
    """release() without a hold raises LockError."""

    async def scenario(client):
        with pytest.raises(LockError):
            await make(client, lock_class).release()

    arun(scenario)


@pytest.mark.parametrize("operation", ["release", "extend", "reacquire"])
def test_operations_on_a_stolen_lock_raise_and_spare_the_thief(arun, lock_class, operation):
    """release/extend/reacquire of a lock someone else now holds raise LockNotOwnedError."""

    async def scenario(client):
        lock = make(client, lock_class, timeout=10)
        assert await lock.acquire(blocking=False)
        await client.set("foo", "a", px=5000)
        method = getattr(lock, operation)
        with pytest.raises(LockNotOwnedError):
            await (method(10) if operation == "extend" else method())
        assert await client.get("foo") == b"a"
        assert 0 < await client.pttl("foo") <= 5000
        if operation == "release":
            assert lock.local.token is None

    arun(scenario)


def test_extend_adds_to_the_ttl_left(arun, lock_class):
    """extend(t) adds t seconds to what is left; replace_ttl=True sets it."""

    async def scenario(client):
        lock = make(client, lock_class, timeout=10)
        assert await lock.acquire(blocking=False)
        assert await lock.extend(10)
        assert 16000 < await client.pttl("foo") <= 20000
        assert await lock.extend(5.0, replace_ttl=True)
        assert 4000 < await client.pttl("foo") <= 5000
        await lock.release()

    arun(scenario)


def test_extend_and_reacquire_need_a_hold_and_a_timeout(arun, lock_class):
    """extend/reacquire raise LockError when not held or when the lock has no timeout."""

    async def scenario(client):
        with pytest.raises(LockError):
            await make(client, lock_class, timeout=10).extend(10)
        with pytest.raises(LockError):
            await make(client, lock_class, timeout=10).reacquire()
        lock = make(client, lock_class)
        assert await lock.acquire(blocking=False)
        with pytest.raises(LockError):
            await lock.extend(10)
        with pytest.raises(LockError):
            await lock.reacquire()
        await lock.release()

    arun(scenario)


def test_reacquire_resets_the_ttl(arun, lock_class):
    """reacquire() sets the TTL back to the lock's timeout."""

    async def scenario(client):
        lock = make(client, lock_class, timeout=10)
        assert await lock.acquire(blocking=False)
        await client.pexpire("foo", 5000)
        assert await lock.reacquire()
        assert 8000 < await client.pttl("foo") <= 10000
        await lock.release()

    arun(scenario)


def test_task_local_tokens_are_not_shared(arun):
    """Per-task tokens: another task's release raises LockError and spares the hold.

    Only for celery_redlock.asyncio.Lock: redis-py's asyncio Lock keeps its token
    per thread, which every task of a loop shares, so the other task's release
    would delete the lock.
    """

    async def scenario(client):
        lock = make(client, celery_redlock.asyncio.Lock, timeout=10)
        assert await lock.acquire(blocking=False)

        async def release_from_another_task():
            await lock.release()

        with pytest.raises(LockError):
            await asyncio.ensure_future(release_from_another_task())
        assert await lock.owned()
        await lock.release()

    arun(scenario)


def test_shared_tokens_with_thread_local_false(arun, lock_class):
    """With thread_local=False, a lock taken in one task can be released in another."""

    async def scenario(client):
        lock = make(client, lock_class, timeout=10, thread_local=False)
        assert await lock.acquire(blocking=False)

        async def release_from_another_task():
            await lock.release()

        await asyncio.ensure_future(release_from_another_task())
        assert await client.get("foo") is None

    arun(scenario)


def test_release_error_can_be_downgraded_to_a_warning(arun, lock_class):
    """raise_on_release_error=False logs instead of raising when the lock was lost."""

    async def scenario(client):
        async with lock_class(client, "foo", timeout=10, raise_on_release_error=False):
            await client.set("foo", "other")
        assert await client.get("foo") == b"other"

    arun(scenario)


class _FastLoop(asyncio.SelectorEventLoop):
    """A loop whose clock runs a thousand times faster than the real one (virtual time)."""

    def time(self) -> float:
        return super().time() * 1000


def test_blocking_timeout_is_measured_on_the_running_loops_clock(redis_server):
    """blocking_timeout counts loop time, as asyncio.sleep and asyncio.timeout do."""

    async def scenario() -> bool:
        client = redis.asyncio.Redis(port=redis_server.port)
        try:
            holder = celery_redlock.asyncio.Lock(client, "loopclock", timeout=60)
            assert await holder.acquire(blocking=False)
            # The loop's selector waits out each sleep in real seconds (0.05 s,
            # 50 loop seconds): 600 loop seconds are 0.6 s of real time on this
            # loop, ten minutes on the wall clock (far past the test's own
            # timeout). A sleep of 5 would be one attempt and a 5 s wait.
            waiter = celery_redlock.asyncio.Lock(client, "loopclock", timeout=60, sleep=0.05)
            got = await waiter.acquire(blocking=True, blocking_timeout=600)
            await holder.release()
            return got
        finally:
            await client.aclose()

    loop = _FastLoop()
    try:
        assert loop.run_until_complete(scenario()) is False
    finally:
        loop.close()


class VirtualLoopTime:
    """Stands in for the ``asyncio`` that redis-py's asyncio lock module sees: virtual time."""

    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def get_running_loop(self):
        return self

    def time(self):
        return self.now

    async def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_blocking_wait_runs_on_the_time_a_test_fakes_for_redis_py(arun, lock_class, monkeypatch):
    """A test that fakes the loop time of redis-py's asyncio lock fakes it for both locks."""
    virtual = VirtualLoopTime()

    async def scenario(client):
        holder = make(client, lock_class)
        assert await holder.acquire(blocking=False)
        monkeypatch.setattr(redis.asyncio.lock, "asyncio", virtual)
        try:
            waiter = make(client, lock_class, blocking_timeout=0.5, sleep=0.125)
            assert not await waiter.acquire()
        finally:
            monkeypatch.undo()
        await holder.release()

    arun(scenario)
    # Powers of two keep the virtual clock exact: four sleeps reach the timeout.
    assert virtual.sleeps == [0.125] * 4
    assert virtual.now == 0.5
