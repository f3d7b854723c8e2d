"""The lock stays safe across paused holders, script flushes and server restarts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redlock import Lock, LockNotOwned, fence_key_for
from celery_redlock.core.fences import FENCE_COUNTER
from celery_redlock.core.scripts import ACQUIRE
from tests.hold_log import fences_drawn_for

FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"


def paused_holder(url: str, conn) -> None:
    lock = Lock(redis.Redis.from_url(url), "paused", timeout=1, auto_renew=True)
    assert lock.acquire(blocking=False)
    conn.send(lock.fence)
    conn.recv()  # the parent stops us, takes the lock, resumes us, then says go
    outcome = {"lost_before_release": lock.lost}
    try:
        lock.release()
        outcome["release"] = "released"
    except LockNotOwned:
        outcome["release"] = "LockNotOwned"
    conn.send(outcome)


@pytest.mark.filterwarnings(FORK_WARNING)
def test_holder_paused_past_its_ttl_loses_and_cannot_hurt_the_new_holder(redis_server):
    """SIGSTOP beyond the TTL: the old holder learns it is lost and the new holder is safe."""
    client = redis_server.client()
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=paused_holder, args=(redis_server.url, child_end))
    child.start()
    try:
        old_fence = parent_end.recv()
        os.kill(child.pid, signal.SIGSTOP)
        new = Lock(client, "paused", timeout=10, sleep=0.05, blocking_timeout=5)
        assert new.acquire()
        assert new.fence > old_fence
    finally:
        os.kill(child.pid, signal.SIGCONT)
    parent_end.send("go")
    outcome = parent_end.recv()
    child.join(timeout=5)
    assert outcome == {"lost_before_release": True, "release": "LockNotOwned"}
    assert new.owned()
    new.release()


def test_every_operation_survives_script_flush(redis_server):
    """Acquire, extend, reacquire and release each work right after SCRIPT FLUSH."""
    client = redis_server.client()
    lock = Lock(client, "flush", timeout=10)
    client.script_flush()
    assert lock.acquire(blocking=False)
    first = lock.fence
    client.script_flush()
    assert lock.extend(5)
    client.script_flush()
    assert lock.reacquire()
    client.script_flush()
    lock.release()
    client.script_flush()
    assert lock.acquire(blocking=False)
    assert lock.fence > first
    lock.release()


def test_restart_between_operations(redis_server):
    """After a restart (empty dataset) the old hold is gone; new holds work, with higher fences."""
    client = redis_server.client()
    old = Lock(client, "restart", timeout=10)
    assert old.acquire(blocking=False)
    redis_server.restart()
    # The old hold vanished with the dataset: its release must say so, not pass silently.
    with pytest.raises(LockNotOwned):
        old.release()
    new = Lock(client, "restart", timeout=10)
    assert new.acquire(blocking=False)
    # Fences are seeded from the server clock, so they keep rising after data loss.
    assert new.fence > old.lease.fence
    assert new.extend(1)
    assert new.reacquire()
    new.release()


def test_fence_keys_expire_and_fences_still_rise(redis_server):
    """Fence keys carry a TTL, so no key outlives its use, and fences still increase."""
    client = redis_server.client()
    lock = Lock(client, "ephemeral", timeout=0.05, fence_retention=0.05)
    assert lock.acquire(blocking=False)
    first = lock.fence
    lock.release()
    deadline = time.monotonic() + 2
    while client.dbsize() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.dbsize() == 0
    assert lock.acquire(blocking=False)
    assert lock.fence > first
    lock.release()


def test_a_name_in_use_never_reseeds_its_fences(redis_server):
    """Each acquisition renews the fence key: fences of a busy name are consecutive."""
    client = redis_server.client()
    lock = Lock(client, "busy", timeout=1, fence_retention=0.3)
    fences = fences_drawn_for(lock, 1.0)  # three times the retention
    assert fences == list(range(fences[0], fences[0] + len(fences)))
    assert 0 < client.pttl(fence_key_for("busy")) <= 300


def test_unreachable_server_raises_a_connection_error(redis_server):
    """With the server gone, acquire raises ConnectionError rather than returning False."""
    # No retries: redis-py 8 retries a refused connection ten times with backoff
    # (about 4 s), which this test of the error would only wait out.
    client = redis_server.client(socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    redis_server.stop()
    with pytest.raises(redis.exceptions.ConnectionError):
        Lock(client, "gone", timeout=1).acquire(blocking=False)


def test_a_timed_out_reply_is_never_read_by_the_next_operation(redis_server):
    """After a timeout the connection is dropped, so a late reply cannot answer a later call."""
    client = redis_server.client(socket_timeout=0.3)
    holder = Lock(client, "late", timeout=10)
    assert holder.acquire(blocking=False)
    redis_server.pause()
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            Lock(client, "late", timeout=10).acquire(blocking=False)  # its reply comes late
    finally:
        redis_server.resume()
    # Were the late reply (a contended answer) read now, this release would misread it.
    holder.release()
    assert client.get("late") is None
    other = Lock(client, "late", timeout=10)
    assert other.acquire(blocking=False)
    assert other.fence > holder.lease.fence


def test_a_resent_acquire_is_idempotent(redis_server):
    """An acquire whose reply was lost and is sent again finds its own token and holds the lock.

    Only the resend (ARGV[4] "1", sent by the script layer) may: a first send
    with a token that holds the lock is another acquirer's, and is refused.
    """
    client = redis_server.client()
    first = Lock(client, "resent", timeout=10)
    assert first.acquire(blocking=False, token="attempt-1")
    client.pexpire("resent", 2000)
    keys = ("resent", fence_key_for("resent"))
    assert isinstance(ACQUIRE(client, keys, ("attempt-1", 10000, 3600000, "0")), list)
    fence = ACQUIRE(client, keys, ("attempt-1", 10000, 3600000, "1"))  # what a resend sends
    assert fence > first.fence
    assert 9000 < client.pttl("resent") <= 10000  # its TTL starts over
    assert isinstance(ACQUIRE(client, keys, ("other", 10000, 3600000, "1")), list)


def test_bytes_names_and_single_connection_clients_work(redis_server):
    """Byte-string names and single-connection clients, both accepted by redis-py, work too."""
    client = redis_server.client(single_connection_client=True)
    lock = client.lock(b"bytes-name", timeout=5, lock_class=Lock)
    with lock:
        assert client.get(b"bytes-name") == lock.token
        assert client.exists(FENCE_COUNTER.encode())
    assert not client.exists(b"bytes-name")


def test_a_lease_past_its_deadline_reads_lost_before_any_watchdog_pass(r):
    """A holder that slept past its validity finds out on its first look at ``lost``.

    No watchdog runs here (auto_renew off), as for a process frozen so long
    that the watchdog could not renew: ``Lease.lost`` (what ``current_lock()``
    hands a task) must not wait for a renewal pass to say so.
    """
    now = [1000.0]
    lock = Lock(r, "lost:deadline", timeout=2, auto_renew=False, clock=lambda: now[0])
    assert lock.acquire(blocking=False)
    lease = lock.lease
    assert lease is not None and not lease.lost and not lease.known_lost
    now[0] += 10  # the pause: past the 2 s TTL and its validity deadline
    assert lease.lost
    assert lock.lost
    assert not lease.known_lost  # nobody has marked it yet
    assert lease.remaining() == 0.0
    assert not lease.still_to_renew()  # the watchdog's look marks it, once
    assert lease.known_lost and lease.loss_reason is not None


def test_a_released_lease_never_reads_lost_after_its_deadline(r):
    now = [1000.0]
    lock = Lock(r, "lost:released", timeout=2, auto_renew=False, clock=lambda: now[0])
    assert lock.acquire(blocking=False)
    lease = lock.lease
    lock.release()
    now[0] += 10
    assert lease is not None and not lease.lost
