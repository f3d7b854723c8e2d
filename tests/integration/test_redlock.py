"""Redlock over healthy masters: the Lock interface, quorum bookkeeping and fences."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import redis

from celery_redlock import LockError, LockNotOwned, QuorumNotAchieved, Redlock, fence_key_for
from tests.hold_log import fences_drawn_for


def lock_values(servers, name):
    return [server.client().get(name) for server in servers]


def wait_until(predicate, timeout=2.0):
    """Poll ``predicate`` until it holds or ``timeout`` passes; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.005)


def warm(lock, cycles=3):
    """Open connections to every master, so that every master gets every request.

    On first use, connections that open after the vote is won carry no acquire
    (it could overtake the release); once open, every master gets every request.
    """
    for _ in range(cycles):
        assert lock.acquire(blocking=False)
        lock.release()
        time.sleep(0.01)


@pytest.fixture
def five(redis_servers):
    return redis_servers(5)


def test_acquire_sets_the_token_on_every_master_and_release_removes_it(five):
    """A held Redlock's token is on every healthy master; release deletes it everywhere."""
    lock = Redlock([s.client() for s in five], "job", timeout=10)
    warm(lock)
    assert lock.acquire(blocking=False)
    token = lock.token
    assert wait_until(lambda: lock_values(five, "job") == [token] * 5)
    assert lock.owned() and lock.locked()
    assert 9.8 < lock.remaining() <= 10
    lock.release()
    assert wait_until(lambda: lock_values(five, "job") == [None] * 5)
    assert not lock.locked()
    assert not lock.owned()


def test_second_holder_is_refused_with_the_holder_named(five):
    """A contender fails with QuorumNotAchieved naming the holder on each master."""
    holder = Redlock([s.client() for s in five], "job", timeout=10)
    other = Redlock([s.url for s in five], "job", timeout=10, blocking_timeout=0.2)
    assert holder.acquire(blocking=False)
    assert not other.acquire(blocking=False)
    with pytest.raises(QuorumNotAchieved) as info, other:
        pass
    error = info.value
    # A master whose connection opened late may have missed the holder's acquire.
    assert error.granted < 3 and error.needed == 3
    assert error.holder == holder.token.decode()
    assert 9 < error.holder_ttl <= 10
    assert set(error.errors) <= set(other.nodes) and len(error.errors) >= 3
    assert f"{error.granted} of 5 masters agreed, 3 needed" in str(error)
    assert other.local.holder[0] == holder.token.decode()
    holder.release()
    assert other.acquire(blocking=False)
    other.release()


def test_extend_and_reacquire_move_the_validity_on_a_majority(five):
    """Extend adds to (or replaces) the TTL on the masters, and validity follows."""
    lock = Redlock([s.client() for s in five], "job", timeout=2)
    assert lock.acquire(blocking=False)
    assert lock.extend(10)
    assert 11 < lock.remaining() <= 12
    assert wait_until(lambda: sum(11000 < s.client().pttl("job") <= 12000 for s in five) >= 3)
    assert lock.extend(3, replace_ttl=True)
    assert 2.8 < lock.remaining() <= 3
    assert lock.reacquire()
    assert 1.8 < lock.remaining() <= 2
    lock.release()


def test_lock_errors_without_a_hold(five):
    """Release and extend without holding raise LockError before any command."""
    lock = Redlock([s.client() for s in five], "job", timeout=2)
    with pytest.raises(LockError):
        lock.release()
    with pytest.raises(LockError):
        lock.extend(1)


def test_fences_strictly_increase_and_are_written_to_a_majority(five):
    """Each acquisition's fence exceeds the last, and a majority's counter holds it."""
    clients = [s.client() for s in five]
    fence_key = fence_key_for("job")
    # Counters far apart: whichever majority answers, fences must keep rising.
    clients[3].set(fence_key, 5 * 10**15)
    fences = []
    for _ in range(20):
        lock = Redlock(clients, "job", timeout=10)
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        counters = [int(c.get(fence_key) or 0) for c in clients]
        assert sum(counter >= lock.fence for counter in counters) >= 3
        lock.release()
    assert fences == sorted(set(fences))


def test_a_name_in_use_never_reseeds_its_fences_on_any_master(five):
    """Drawing and writing back a fence renew every master's key: busy names never reseed."""
    clients = [s.client() for s in five]
    lock = Redlock(clients, "busy", timeout=1, fence_retention=0.3)
    fences = fences_drawn_for(lock, 1.0)  # three times the retention
    assert fences == sorted(set(fences))
    # A reseed jumps to a master's clock in microseconds, at least the 0.3 s
    # retention ahead of the first seed. (Masters seeded a little apart, so
    # the first fences may step by the gap between their seeds.)
    assert max(b - a for a, b in zip(fences, fences[1:])) < 100_000


def test_fence_outlives_the_masters_that_drew_it(five):
    """A fence drawn on one master is written back: later holders exceed it without that master."""
    clients = [s.client() for s in five]
    name, fence_key = "job", fence_key_for("job")
    # The majority must be masters 0..2 (3 and 4 are held by someone else), and
    # only master 0's counter is high: the fence comes from it alone.
    for client in clients[3:]:
        client.set(name, "someone-else", px=10000)
    clients[0].set(fence_key, 7 * 10**15)
    first = Redlock(clients, name, timeout=10)
    assert first.acquire(blocking=False)
    high = first.fence
    assert high > 7 * 10**15
    first.release()
    # Without masters 0 and 1 the next majority is 2..4: it must still go higher.
    five[0].kill()
    five[1].kill()
    for client in clients[3:]:
        client.delete(name)
    second = Redlock(clients, name, timeout=10)
    assert second.acquire(blocking=False), second.local.failure
    assert second.fence > high
    second.release()


def test_failed_attempt_removes_its_keys(five):
    """An attempt that loses the vote deletes the keys it set on the masters that granted them."""
    clients = [s.client() for s in five]
    for client in clients[:3]:
        client.set("job", "someone-else", px=10000)
    lock = Redlock(clients, "job", timeout=10)
    assert not lock.acquire(blocking=False)
    assert wait_until(lambda: lock_values(five, "job")[3:] == [None, None])
    assert lock_values(five, "job")[:3] == [b"someone-else"] * 3


def test_script_flush_on_every_master_is_survived(five):
    """Acquire, extend and release work right after SCRIPT FLUSH on every master."""
    clients = [s.client() for s in five]
    lock = Redlock(clients, "job", timeout=10)
    for client in clients:
        client.script_flush()
    assert lock.acquire(blocking=False)
    for client in clients:
        client.script_flush()
    assert lock.extend(1)
    for client in clients:
        client.script_flush()
    lock.release()
    assert wait_until(lambda: lock_values(five, "job") == [None] * 5)


def test_decoded_clients_and_urls_work_alike(five):
    """Masters given as decode_responses clients or as URLs behave like plain clients."""
    decoded = Redlock([s.client(decode_responses=True) for s in five], "job", timeout=5)
    assert decoded.acquire(blocking=False, token="mine")
    assert decoded.owned()
    decoded.release()
    by_url = Redlock([s.url for s in five], "job", timeout=5)
    assert by_url.acquire(blocking=False)
    assert by_url.owned()
    by_url.release()


def test_masters_that_cannot_be_polled_go_through_the_pool(five):
    """RESP3 clients (run on the thread pool) acquire, exclude, extend and release alike."""
    lock = Redlock([s.client(protocol=3) for s in five], "job", timeout=5)
    rival = Redlock([s.url for s in five], "job", timeout=5)
    assert lock.acquire(blocking=False)
    assert lock.fence is not None
    assert not rival.acquire(blocking=False)
    assert lock.extend(5) and lock.owned()
    lock.release()
    assert rival.acquire(blocking=False)
    rival.release()


def test_no_timeout_means_no_expiry(five):
    """Without a timeout the keys carry no TTL and validity is unbounded."""
    lock = Redlock([s.client() for s in five], "job")
    assert lock.acquire(blocking=False)
    assert lock.remaining() == float("inf")
    pttls = [s.client().pttl("job") for s in five]
    assert pttls.count(-1) >= 3 and set(pttls) <= {-1, -2}
    lock.release()


def test_no_validity_left_counts_as_failure_and_cleans_up(five):
    """A majority reached after the TTL (by the lock's clock) is a failure and leaves no key."""
    now = [1000.0]

    def clock():
        # Each reading jumps past the TTL: the majority always answers "too late".
        now[0] += 2.0
        return now[0]

    lock = Redlock([s.client() for s in five], "job", timeout=1.5, clock=clock, node_timeout=0.1)
    assert not lock.acquire(blocking=False)
    assert "leaving no validity" in str(lock.local.failure)
    assert wait_until(lambda: lock_values(five, "job") == [None] * 5)


def test_threads_share_nodes_but_not_holds(five):
    """Threads contending on one Redlock object never hold it at once."""
    lock = Redlock([s.client() for s in five], "job", timeout=5, sleep=0.005)
    inside = []
    overlaps = []

    def worker():
        for _ in range(15):
            assert lock.acquire(blocking_timeout=10)
            inside.append(1)
            if len(inside) > 1:
                overlaps.append(1)
            time.sleep(0.001)
            inside.pop()
            lock.release()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not overlaps
    assert lock_values(five, "job") == [None] * 5 or wait_until(
        lambda: lock_values(five, "job") == [None] * 5
    )


def test_release_of_an_expired_lock_raises_lock_not_owned(five):
    """A hold that expired unnoticed is reported on release, and marked lost."""
    lock = Redlock([s.client() for s in five], "job", timeout=0.2)
    assert lock.acquire(blocking=False)
    time.sleep(0.3)
    assert lock.lost
    with pytest.raises(LockNotOwned):
        lock.release()
    assert lock.lease.lost


def test_replies_and_commands_larger_than_one_socket_read_keep_connections_in_step(five):
    """A reply spread over many socket reads is waited for and read whole, and a command
    larger than one write goes out whole: every connection stays in step afterwards."""
    lock = Redlock([s.client() for s in five], "big", timeout=10)
    warm(lock)
    held_by = "h" * (1 << 20)  # 1 MiB: many reads of the fan-out's 64 KiB
    for server in five:
        server.client().set("big", held_by, px=10_000)
    assert lock.locked()
    assert not lock.acquire(blocking=False)
    assert lock.local.holder[0] == held_by
    for server in five:
        server.client().delete("big")
    # A token as large, on the connections that just carried the large replies.
    token = b"t" * (1 << 20)
    assert lock.acquire(blocking=False, token=token)
    assert wait_until(lambda: lock_values(five, "big") == [token] * 5)
    assert lock.owned()
    lock.release()
    assert wait_until(lambda: lock_values(five, "big") == [None] * 5)
    warm(lock)


def test_a_shared_counter_past_the_fence_counts_only_where_this_token_holds_the_key(r):
    """RAISE_FENCE on one master: a counter that other names' draws moved past the fence
    counts as a vote where this token holds the lock key (no draw of this name can have
    happened there since its own), not where the key is free, never where another holds it."""
    from celery_redlock.core.scripts import RAISE_FENCE

    counter = fence_key_for("job")
    r.set(counter, 500)
    r.set("job", "mine")
    assert RAISE_FENCE(r, ("job", counter), ("mine", 400, 60_000)) == 1
    assert int(r.get(counter)) == 500  # counters never go down
    r.delete("job")
    assert RAISE_FENCE(r, ("job", counter), ("mine", 400, 60_000)) == 0
    r.set("job", "theirs")
    assert RAISE_FENCE(r, ("job", counter), ("mine", 900, 60_000)) == -1
    assert int(r.get(counter)) == 500
    r.delete("job")
    assert RAISE_FENCE(r, ("job", counter), ("mine", 900, 60_000)) == 1
    assert int(r.get(counter)) == 900


@pytest.mark.timeout(60)
def test_a_forked_child_never_uses_the_connections_its_parent_keeps(five):
    """A parent and a child forked after its cycles run cycles at once, each on its own sockets."""
    lock = Redlock([s.client() for s in five], "job", timeout=10, sleep=0.001)
    warm(lock)
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            for _ in range(100):
                if lock.acquire(blocking_timeout=5):
                    lock.release()
            code = 0
        finally:
            os._exit(code)
    # On a shared socket one process would read the other's replies: votes
    # lost or miscounted, a release that deletes nothing, a token left behind.
    for _ in range(100):
        assert lock.acquire(blocking_timeout=5)
        lock.release()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert wait_until(lambda: lock_values(five, "job") == [None] * 5)


def test_threads_that_end_hand_their_connections_on_to_the_next(five):
    """A thread that ends gives its connections back: threads one after another open none."""
    lock = Redlock([s.client() for s in five], "job", timeout=10)
    warm(lock)

    def opened():
        return sum(s.client().info("stats")["total_connections_received"] for s in five)

    def one_cycle():
        assert lock.acquire(blocking=False)
        lock.release()

    before = opened()
    for _ in range(10):
        thread = threading.Thread(target=one_cycle)
        thread.start()
        thread.join(10)
    # Threads that kept their connections to themselves would open one per
    # master each (50); one that ends just as the next starts may still hold
    # its own, so only most of them are asked to reuse.
    assert opened() - before < len(five) * 10 // 2


@pytest.mark.parametrize("protocol", [2, 3])
def test_redlocks_of_short_lived_clients_leave_no_connection_open(five, protocol):
    """Clients made per call: their connections close as they go, without the cyclic collector.

    Each thread's lane to a master must not keep that master's node (and its
    connection) alive in a reference cycle, which only a full collection
    would break: code that builds its clients per call would pile up idle
    connections towards the servers' ``maxclients``. A RESP3 master is asked
    through a private copy of its client: the copy's pool (itself a cycle in
    redis-py 8) is closed when the node goes. Left to the cyclic collector, a
    socket could even be finalized before its connection, which warns
    ("unclosed socket").
    """
    admin = [s.client() for s in five]

    def connected():
        return [a.info("clients")["connected_clients"] for a in admin]

    before = connected()
    gc.disable()
    try:
        for _ in range(30):
            clients = [redis.Redis(host="127.0.0.1", port=s.port, protocol=protocol) for s in five]
            lock = Redlock(clients, "job", timeout=10)
            assert lock.acquire(blocking=False)
            lock.release()
            del lock, clients
        # Counted before the collector may run again: it would close them.
        after = connected()
    finally:
        gc.enable()
    # Lingering connections would be one per call and master (30 each).
    assert all(now - then < 5 for now, then in zip(after, before)), (before, after)
