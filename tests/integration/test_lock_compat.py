"""celery_redlock.Lock behaves like redis-py's Lock wherever both define behaviour.

Every test here runs twice: against ``redis.lock.Lock`` (the reference) and
against ``celery_redlock.Lock``, created the way users create it, through
``client.lock(name, lock_class=...)``.
"""

from __future__ import annotations

import inspect
import threading

import pytest
import redis.lock
from redis.exceptions import LockError, LockNotOwnedError

import celery_redlock


@pytest.fixture(params=[redis.lock.Lock, celery_redlock.Lock], ids=["redis-py", "celery-redlock"])
def lock_class(request):
    return request.param


@pytest.fixture(params=[False, True], ids=["bytes", "decoded"])
def client(request, redis_server):
    return redis_server.client(decode_responses=request.param)


def make(client, lock_class, name="foo", **kwargs):
    return client.lock(name, lock_class=lock_class, **kwargs)


def as_bytes(value):
    return value.encode() if isinstance(value, str) else value


def test_acquire_stores_the_token_without_expiry(client, lock_class):
    """A lock without timeout stores its token under the name and never expires."""
    lock = make(client, lock_class)
    assert lock.acquire(blocking=False)
    assert as_bytes(client.get("foo")) == lock.local.token
    assert client.ttl("foo") == -1
    lock.release()
    assert client.get("foo") is None


def test_given_token_is_stored_encoded(client, lock_class):
    """acquire(token=...) stores exactly that token and clears it on release."""
    lock = make(client, lock_class)
    assert lock.acquire(blocking=False, token="test")
    assert as_bytes(client.get("foo")) == b"test"
    assert lock.local.token == b"test"
    lock.release()
    assert lock.local.token is None


def test_locked_and_owned_track_the_holder(client, lock_class):
    """locked() sees any holder; owned() only our own hold."""
    first, second = make(client, lock_class), make(client, lock_class)
    assert not first.locked()
    assert first.acquire(blocking=False)
    assert first.locked() and second.locked()
    assert first.owned() and not second.owned()
    first.release()
    assert not first.locked() and not first.owned()


def test_competing_locks_exclude_each_other(client, lock_class):
    """Two instances on one name never hold it together."""
    first, second = make(client, lock_class), make(client, lock_class)
    assert first.acquire(blocking=False)
    assert not second.acquire(blocking=False)
    first.release()
    assert second.acquire(blocking=False)
    assert not first.acquire(blocking=False)
    second.release()


@pytest.mark.parametrize(("timeout", "low", "high"), [(10, 8000, 10000), (9.5, 8000, 9500)])
def test_timeout_sets_the_key_expiry(client, lock_class, timeout, low, high):
    """The key expires after the lock's timeout, integer or float."""
    lock = make(client, lock_class, timeout=timeout)
    assert lock.acquire(blocking=False)
    assert low < client.pttl("foo") <= high
    lock.release()


def acquire_attempts(redis_server):
    """Lock acquisitions the server ran since its last stats reset: scripts, else SET NX.

    (The server counts the commands a script runs too: the script's own SET
    is not an attempt of its own.)
    """
    calls = redis_server.commandstats()
    return calls.get("evalsha", 0) + calls.get("eval", 0) or calls.get("set", 0)


def test_blocking_timeout_gives_up_in_time(client, lock_class, redis_server):
    """A blocked acquire tries again every sleep, and returns False by blocking_timeout."""
    holder = make(client, lock_class)
    assert holder.acquire(blocking=False)
    waiter = make(client, lock_class, blocking_timeout=1.0, sleep=0.05)
    redis_server.reset_stats()
    assert not waiter.acquire()
    # Each retry follows a 0.05 s sleep, so no more than 1 + 1.0 / 0.05 attempts
    # fit into the blocking timeout, however slow the machine; at least one
    # retry does unless the first round trip alone took 0.95 s.
    assert 2 <= acquire_attempts(redis_server) <= 21
    holder.release()


def test_blocking_acquire_waits_for_release(client, lock_class):
    """A blocked acquire succeeds once the holder releases."""
    holder = make(client, lock_class, thread_local=False)
    assert holder.acquire(blocking=False)
    timer = threading.Timer(0.2, holder.release)
    timer.start()
    try:
        waiter = make(client, lock_class, sleep=0.01, blocking_timeout=5)
        assert waiter.acquire()
        waiter.release()
    finally:
        timer.join()


def test_context_manager_releases(client, lock_class):
    """Leaving the with block releases the lock."""
    with make(client, lock_class, blocking_timeout=0.2) as lock:
        assert as_bytes(client.get("foo")) == lock.local.token
    assert client.get("foo") is None


def test_context_manager_raises_when_not_acquired(client, lock_class):
    """Entering a with block on a held lock raises LockError after blocking_timeout."""
    client.set("foo", "bar")
    with pytest.raises(LockError), make(client, lock_class, blocking_timeout=0.1):
        pass


def test_releasing_an_unheld_lock_raises(client, lock_class):
    """release() without a hold raises LockError."""
    with pytest.raises(LockError):
        make(client, lock_class).release()


@pytest.mark.parametrize("operation", ["release", "extend", "reacquire"])
def test_operations_on_a_stolen_lock_raise_and_spare_the_thief(client, lock_class, operation):
    """release/extend/reacquire of a lock someone else now holds raise LockNotOwnedError."""
    lock = make(client, lock_class, timeout=10)
    assert lock.acquire(blocking=False)
    client.set("foo", "a", px=5000)
    method = getattr(lock, operation)
    with pytest.raises(LockNotOwnedError):
        method(10) if operation == "extend" else method()
    assert as_bytes(client.get("foo")) == b"a"
    assert 0 < client.pttl("foo") <= 5000
    if operation == "release":
        assert lock.local.token is None


def test_extend_adds_to_the_ttl_left(client, lock_class):
    """extend(t) adds t seconds to what is left; replace_ttl=True sets it."""
    lock = make(client, lock_class, timeout=10)
    assert lock.acquire(blocking=False)
    assert lock.extend(10)
    assert 16000 < client.pttl("foo") <= 20000
    assert lock.extend(5.0, replace_ttl=True)
    assert 4000 < client.pttl("foo") <= 5000
    lock.release()


def test_extend_and_reacquire_need_a_hold_and_a_timeout(client, lock_class):
    """extend/reacquire raise LockError when not held or when the lock has no timeout."""
    with pytest.raises(LockError):
        make(client, lock_class, timeout=10).extend(10)
    with pytest.raises(LockError):
        make(client, lock_class, timeout=10).reacquire()
    lock = make(client, lock_class)
    assert lock.acquire(blocking=False)
    with pytest.raises(LockError):
        lock.extend(10)
    with pytest.raises(LockError):
        lock.reacquire()
    lock.release()


def test_reacquire_resets_the_ttl(client, lock_class):
    """reacquire() sets the TTL back to the lock's timeout."""
    lock = make(client, lock_class, timeout=10)
    assert lock.acquire(blocking=False)
    client.pexpire("foo", 5000)
    assert lock.reacquire()
    assert 8000 < client.pttl("foo") <= 10000
    lock.release()


def test_thread_local_tokens_are_not_shared(client):
    """With thread_local, another thread's release raises LockError and spares the hold.

    Only for celery_redlock.Lock: redis-py's Lock raises AttributeError there,
    since its thread-local token has no default in other threads.
    """
    lock = make(client, celery_redlock.Lock, timeout=10)
    assert lock.acquire(blocking=False)
    errors = []

    def release_from_other_thread():
        try:
            lock.release()
        except LockError as exc:
            errors.append(exc)

    thread = threading.Thread(target=release_from_other_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert lock.owned()
    lock.release()


def test_non_thread_local_tokens_are_shared(client, lock_class):
    """With thread_local=False, a lock taken in one thread can be released in another."""
    lock = make(client, lock_class, timeout=10, thread_local=False)
    assert lock.acquire(blocking=False)
    thread = threading.Thread(target=lock.release)
    thread.start()
    thread.join()
    assert client.get("foo") is None


def test_release_error_can_be_downgraded_to_a_warning(client, lock_class, caplog):
    """raise_on_release_error=False logs instead of raising when the lock was lost."""
    if "raise_on_release_error" not in inspect.signature(lock_class).parameters:
        pytest.skip("this redis-py version's Lock has no raise_on_release_error")
    with lock_class(client, "foo", timeout=10, raise_on_release_error=False):
        client.set("foo", "other")
    assert as_bytes(client.get("foo")) == b"other"


class VirtualTime:
    """Stands in for the ``time`` module of redis-py's lock: a clock that only sleeps move."""

    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_blocking_wait_runs_on_the_time_a_test_fakes_for_redis_py(client, lock_class, monkeypatch):
    """A test that fakes time for redis-py's lock (its module's ``mod_time``) fakes it for both.

    Powers of two keep the virtual clock exact: four sleeps of 0.125 s reach the
    0.5 s blocking timeout, and a fifth would pass it.
    """
    virtual = VirtualTime()
    monkeypatch.setattr(redis.lock, "mod_time", virtual)
    holder = make(client, lock_class)
    assert holder.acquire(blocking=False)
    waiter = make(client, lock_class, blocking_timeout=0.5, sleep=0.125)
    assert not waiter.acquire()
    assert virtual.sleeps == [0.125] * 4
    assert virtual.now == 0.5
    with pytest.raises(LockError), make(client, lock_class, blocking_timeout=0.25, sleep=0.125):
        pass
    assert virtual.sleeps == [0.125] * 6
    holder.release()


def test_a_lock_given_its_own_clock_waits_on_it(redis_server, monkeypatch):
    """A clock passed to celery-redlock's lock measures its blocking wait, not redis-py's time."""
    monkeypatch.setattr(redis.lock, "mod_time", VirtualTime())
    virtual = VirtualTime()
    monkeypatch.setattr("time.sleep", virtual.sleep)
    client = redis_server.client()
    assert celery_redlock.Lock(client, "foo").acquire(blocking=False)
    waiter = celery_redlock.Lock(
        client, "foo", blocking_timeout=0.5, sleep=0.125, clock=lambda: virtual.now
    )
    assert not waiter.acquire()
    assert virtual.sleeps == [0.125] * 4
