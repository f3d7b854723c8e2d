"""Redlock when masters die, hang or come back empty: a majority decides, quickly."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import redis

from celery_redlock import QuorumNotAchieved, Redlock
from tests.integration.test_redlock import wait_until, warm


def run_within(window, call):
    """Return ``call()``, run in a thread; fail if it has not returned within ``window`` seconds.

    The window is an event wait, not a speed test: each test states why a
    call that misbehaves cannot return within it, and leaves a loaded machine
    a wide margin.
    """
    outcome = {}

    def target():
        try:
            outcome["result"] = call()
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(window)
    assert not thread.is_alive(), f"{call!r} has not returned within {window} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def test_two_of_five_killed_still_acquires_and_excludes(redis_servers):
    """With 2 of 5 masters dead the lock is still granted, to one holder at a time."""
    servers = redis_servers(5)
    clients = [s.client() for s in servers]
    holder = Redlock(clients, "job", timeout=10)
    warm(holder)
    servers[0].kill()
    servers[4].kill()
    assert holder.acquire(blocking=False)
    other = Redlock([s.url for s in servers], "job", timeout=10)
    assert not other.acquire(blocking=False)
    assert isinstance(other.local.failure, QuorumNotAchieved)
    holder.release()
    assert other.acquire(blocking=False)
    other.release()


def test_three_of_five_killed_fails_with_every_error_and_leaves_no_key(redis_servers):
    """Without a majority, acquisition fails naming each dead master, and survivors keep no key."""
    servers = redis_servers(5)
    lock = Redlock([s.client() for s in servers], "job", timeout=10, blocking_timeout=0.3)
    warm(lock)
    dead = [servers[1], servers[2], servers[3]]
    for server in dead:
        server.kill()
    with pytest.raises(QuorumNotAchieved) as info, lock:
        pass
    error = info.value
    assert error.granted <= 2 and error.needed == 3
    dead_names = {f"127.0.0.1:{s.port}/0" for s in dead}
    assert dead_names <= set(error.errors)
    assert all(isinstance(error.errors[name], redis.ConnectionError) for name in dead_names)
    for name in dead_names:
        assert name in str(error)
    survivors = [servers[0].client(), servers[4].client()]
    # The releases run within moments; the TTL (10 s) is far away.
    assert wait_until(lambda: all(c.get("job") is None for c in survivors), timeout=5.0)


@pytest.mark.timeout(60)
def test_hung_master_does_not_slow_acquisition(redis_servers):
    """A SIGSTOPped master costs acquire+release nothing: none of them waits for it."""
    servers = redis_servers(5)
    assert Redlock([s.client() for s in servers], "job", timeout=10).node_timeout == 1.0
    # Node timeouts longer than the windows below: an acquire or release that
    # waited for the hung master could not return within them.
    lock = Redlock([s.client() for s in servers], "job", timeout=120, node_timeout=30)
    warm(lock)
    servers[2].pause()
    try:

        def cycles():
            for _ in range(30):
                assert lock.acquire(blocking=False)
                lock.release()

        run_within(20, cycles)
        # A master nobody has connected to yet: its connect hangs in the pool.
        fresh = Redlock([s.url for s in servers], "job", timeout=120, node_timeout=30)

        def fresh_cycle():
            assert fresh.acquire(blocking=False)
            fresh.release()

        run_within(20, fresh_cycle)
    finally:
        servers[2].resume()


@pytest.mark.timeout(30)
def test_hung_majority_fails_within_the_node_timeout(redis_servers):
    """With too many masters hung, a failed attempt waits for them once, all at once."""
    servers = redis_servers(5)
    lock = Redlock([s.client() for s in servers], "job", timeout=10, node_timeout=2)
    warm(lock)
    for server in servers[:3]:
        server.pause()
    try:

        def attempt():
            assert not lock.acquire(blocking=False)
            return lock.local.failure

        # Waiting for the three one after another would take three node
        # timeouts; the window is two (one to spare for a loaded machine).
        error = run_within(2 * lock.node_timeout, attempt)
    finally:
        for server in servers[:3]:
            server.resume()
    # Each hung master's error says it was waited for until the node timeout.
    assert sum("node timeout" in str(e) for e in error.errors.values()) == 3
    # Once they resume, the releases queued behind the acquires leave no key.
    assert wait_until(lambda: all(s.client().get("job") is None for s in servers))


@pytest.mark.parametrize("masters", [3, 5])
def test_minority_restarted_empty_does_not_break_exclusion(redis_servers, masters):
    """A master that restarts without data during a hold cannot hand the lock to a second holder."""
    servers = redis_servers(masters)
    clients = [s.client() for s in servers]
    holder = Redlock(clients, "job", timeout=10)
    warm(holder)
    assert holder.acquire(blocking=False)
    # Held on every master before one restarts. The vote may be decided before
    # the last master ran the acquire; on a loaded machine it could run the
    # rival's first, and the rival would win with it and the restarted master.
    # A lock held by a bare majority is what the restart rule (a master comes
    # back only after a TTL, docs/redlock.md) protects, not this test.
    assert wait_until(lambda: all(c.get("job") == holder.token for c in clients))
    servers[0].restart()
    assert servers[0].client().get("job") is None
    rival = Redlock([s.url for s in servers], "job", timeout=10)
    assert not rival.acquire(blocking=False)
    assert rival.local.failure.granted <= 1
    assert holder.owned()
    assert not holder.lost
    holder.release()
    assert wait_until(lambda: all(c.get("job") is None for c in clients))
    assert rival.acquire(blocking=False)
    rival.release()


def test_master_restarted_between_operations_is_reconnected(redis_servers):
    """Connections left open to a restarted master are replaced without failing a vote."""
    servers = redis_servers(3)
    lock = Redlock([s.client() for s in servers], "job", timeout=10)
    warm(lock)
    for server in servers:
        server.restart()
    assert lock.acquire(blocking=False), lock.local.failure
    lock.release()


def test_a_failed_redlock_is_freed_as_soon_as_it_is_dropped(redis_servers):
    """A Redlock keeps its last failure but no reference cycle: dropped, it goes at once.

    The failure names each master's error. Were those errors to keep their
    tracebacks, the frames in them would hold the lock, and with it the
    connections it reaches, until the cyclic collector runs; and that
    collector finalizes a socket and its connection in no set order, which
    can warn of an unclosed socket.
    """
    servers = redis_servers(3)
    servers[1].client().set("job", "someone else")
    servers[2].kill()
    clients = [s.client() for s in servers]
    gc.disable()
    try:
        lock = Redlock(clients, "job", timeout=10)
        assert not lock.acquire(blocking=False)
        failure = lock.local.failure
        assert isinstance(failure, QuorumNotAchieved)
        assert isinstance(failure.errors[f"127.0.0.1:{servers[2].port}/0"], redis.ConnectionError)
        gone = weakref.ref(lock)
        del lock, failure
        assert gone() is None
    finally:
        gc.enable()
