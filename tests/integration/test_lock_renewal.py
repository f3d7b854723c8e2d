"""The watchdog keeps auto-renewed locks alive, batches renewals and reports losses."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import threading
import time

import pytest

from celery_redlock import Lock, Watchdog, default_watchdog
from tests.hand_driven import ManualClock, NeverStarted

FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"


def lost_event(lock_kwargs: dict) -> tuple[threading.Event, dict]:
    """Return an event set by on_lost and kwargs that wire it in."""
    event = threading.Event()
    return event, {**lock_kwargs, "on_lost": lambda lease: event.set()}


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` seconds.

    The timeouts are windows far longer than the waits they bound, for a
    loaded machine: a test asserts what happened, never how fast.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


def test_auto_renewed_lock_outlives_its_ttl_many_times(redis_server):
    """A 1 s lock renewed 12 times (held 4 s or more) is still ours, and never reported lost."""
    client = redis_server.client()
    lock = Lock(client, "long", timeout=1, auto_renew=True, watchdog=Watchdog())
    assert lock.acquire(blocking=False)
    wait_until(lambda: lock.lease.renewals >= 12 or lock.lost, 30, "12 renewals")
    assert lock.owned()
    assert not lock.lost
    assert 0 < lock.remaining() <= 1
    lock.release()
    assert client.get("long") is None


@pytest.mark.timeout(60)
def test_a_thousand_locks_cost_one_round_trip_per_period(redis_server):
    """1,000 auto-renewed locks are renewed with one command per renewal period."""
    client = redis_server.client()
    watchdog = Watchdog()
    locks = [
        Lock(client, f"many:{i}", timeout=1.5, auto_renew=True, fencing=False, watchdog=watchdog)
        for i in range(1000)
    ]
    for lock in locks:
        assert lock.acquire(blocking=False)
    before = [lock.lease.renewals for lock in locks]
    redis_server.reset_stats()
    wait_until(lambda: all(lock.lease.renewals >= 6 for lock in locks), 30, "6 renewals of each")
    renew_calls = redis_server.commandstats().get("evalsha", 0)
    after = [lock.lease.renewals for lock in locks]
    passes = min(a - b for a, b in zip(after, before))
    # One call per pass renews every lock; a pass may straddle the reset or
    # run while the renewals are counted.
    assert passes >= 5
    assert renew_calls <= passes + 2
    assert not any(lock.lost for lock in locks)
    for lock in locks:
        lock.release()
    assert client.dbsize() == 0


@pytest.mark.parametrize("tamper", ["delete", "overwrite"])
def test_lock_taken_away_is_reported_lost_within_one_renewal_period(redis_server, tamper):
    """Deleting or overwriting the key behind the holder's back is noticed at the next renewal."""
    client = redis_server.client()
    event, kwargs = lost_event({"timeout": 1.5, "auto_renew": True, "watchdog": Watchdog()})
    lock = Lock(client, "victim", **kwargs)
    assert lock.acquire(blocking=False)
    if tamper == "delete":
        client.delete("victim")
    else:
        client.set("victim", "intruder", px=10_000)
    renewals = lock.lease.renewals
    redis_server.reset_stats()
    assert event.wait(timeout=10)
    # The first renewal sent after the tampering reported the loss: no renewal
    # succeeded meanwhile, and the server ran at most one (one that ran before
    # the reset counts neither here nor there).
    assert lock.lease.renewals == renewals
    assert redis_server.commandstats().get("evalsha", 0) <= 1
    assert lock.lost
    assert lock.lease.loss_reason == "the key no longer holds this lease's token"
    if tamper == "overwrite":
        assert client.get("victim") == b"intruder"


def test_hung_server_marks_the_lock_lost_by_its_deadline_and_watchdog_recovers(redis_server):
    """A server that stops answering costs the lock by its validity deadline, not a hang."""
    # No socket timeout on the lock's client: a watchdog that waited on it
    # would hang for as long as the server does.
    client = redis_server.client(socket_timeout=None)
    watchdog = Watchdog()
    past_deadline: list[bool] = []
    lock = Lock(
        client,
        "hung",
        timeout=1,
        auto_renew=True,
        watchdog=watchdog,
        on_lost=lambda lease: past_deadline.append(lease.deadline <= time.monotonic()),
    )
    assert lock.acquire(blocking=False)
    redis_server.pause()
    try:
        # A window far past the 1 s validity plus one bounded renewal attempt,
        # while the server stays hung throughout.
        wait_until(lambda: past_deadline, 20, "the loss of the lock")
        assert "validity" in lock.lease.loss_reason
    finally:
        redis_server.resume()
    assert past_deadline == [True]  # given up when its validity ran out, not before
    again = Lock(client, "hung2", timeout=0.6, auto_renew=True, watchdog=watchdog)
    assert again.acquire(blocking=False)
    wait_until(lambda: again.lease.renewals >= 3 or again.lost, 20, "3 renewals after the hang")
    assert again.owned() and not again.lost
    again.release()


def test_renewal_survives_script_flush(redis_server):
    """After SCRIPT FLUSH the watchdog reloads its script and keeps the lock."""
    client = redis_server.client()
    lock = Lock(client, "flushed", timeout=0.6, auto_renew=True, watchdog=Watchdog())
    assert lock.acquire(blocking=False)
    client.script_flush()
    renewals = lock.lease.renewals
    wait_until(lambda: lock.lease.renewals >= renewals + 2 or lock.lost, 20, "2 renewals")
    assert lock.owned() and not lock.lost
    client.script_flush()
    lock.release()


def test_released_lock_is_not_reported_lost(redis_server, caplog):
    """Releasing while a renewal is due never raises a false loss."""
    client = redis_server.client()
    watchdog = Watchdog()
    losses: list[str] = []
    for _ in range(50):
        lock = Lock(
            client,
            "brief",
            timeout=0.1,
            auto_renew=True,
            watchdog=watchdog,
            on_lost=lambda lease: losses.append(lease.name),
        )
        assert lock.acquire(blocking=False)
        time.sleep(0.03)
        lock.release()
        assert not lock.lost
    # Two renewals of a probe on the same watchdog come after every renewal
    # the released leases would have been due for (a third of 0.1 s).
    probe = Lock(client, "probe", timeout=0.3, auto_renew=True, watchdog=watchdog)
    assert probe.acquire(blocking=False)
    wait_until(lambda: probe.lease.renewals >= 2, 20, "2 renewals of the probe")
    probe.release()
    assert losses == []
    assert "lost" not in caplog.text


def test_garbage_collected_lock_is_left_to_expire(redis_server, caplog):
    """A lock object dropped while held stops being renewed, so the key expires."""
    client = redis_server.client()
    caplog.set_level(logging.WARNING)
    # A TTL long enough that a watchdog pass delayed by a loaded machine still
    # comes before the lease's validity ends (and would renew a live lock).
    lock = Lock(client, "orphan", timeout=1.5, auto_renew=True, watchdog=Watchdog())
    assert lock.acquire(blocking=False)
    del lock
    gc.collect()
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline and client.exists("orphan"):
        time.sleep(0.05)
    assert client.get("orphan") is None
    assert "garbage-collected while held" in caplog.text


def child_holds_auto_renewed_lock(url: str, results) -> None:
    import redis

    inherited = default_watchdog().watched()
    lock = Lock(redis.Redis.from_url(url), "child", timeout=0.6, auto_renew=True)
    assert lock.acquire(blocking=False)
    wait_until(lambda: lock.lease.renewals >= 4 or lock.lost, 20, "4 renewals in the child")
    results.put((inherited, lock.owned(), lock.lost, lock.lease.renewals))
    lock.release()


@pytest.mark.filterwarnings(FORK_WARNING)
def test_watchdog_restarts_in_a_forked_child(redis_server):
    """A forked child gets its own watchdog thread and none of its parent's leases."""
    client = redis_server.client()
    parent_lock = Lock(client, "parent", timeout=1, auto_renew=True)
    assert parent_lock.acquire(blocking=False)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=child_holds_auto_renewed_lock, args=(redis_server.url, results))
    child.start()
    inherited, owned, lost, renewals = results.get(timeout=30)
    child.join(timeout=5)
    assert inherited == 0
    assert owned and not lost
    assert renewals >= 4
    assert parent_lock.owned() and not parent_lock.lost
    parent_lock.release()


@pytest.mark.timeout(120)
def test_three_thousand_locks_renew_in_one_write_per_period_for_five_ttls(
    redis_server, monkeypatch
):
    """3,000 held locks, 15 renewal passes (5 TTLs) driven by hand: each pass is one write
    on one connection carrying three script calls, renews every lock once, loses none."""
    import redis.connection

    client = redis_server.client()
    clock = ManualClock()
    watchdog = Watchdog(clock=clock)
    watchdog._thread = NeverStarted()  # passes driven by hand
    locks = [Lock(client, f"held:{i}", timeout=30, clock=clock) for i in range(3000)]
    for lock in locks:
        assert lock.acquire(blocking=False)
        watchdog.watch(lock.lease)
    writes: list[int] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def counting(self, *args, **kwargs):
        writes.append(self.port)
        return send(self, *args, **kwargs)

    for period in range(1, 16):
        clock.now += 10  # a third of the TTL
        if period == 2:  # the first pass opened the connection and cached the script
            redis_server.reset_stats()
            monkeypatch.setattr(
                redis.connection.AbstractConnection, "send_packed_command", counting
            )
        writes.clear()
        watchdog.renew_due()
        if period >= 2:
            assert writes == [redis_server.port]
        assert [lock.lease.renewals for lock in locks] == [period] * 3000
    monkeypatch.undo()
    assert redis_server.commandstats().get("evalsha", 0) == 14 * 3  # 1,000 keys a call
    assert not any(lock.lost for lock in locks)
    pipe = client.pipeline(transaction=False)
    for lock in locks:
        pipe.pttl(lock.name)
    assert all(0 < ttl <= 30_000 for ttl in pipe.execute())
    for lock in locks:
        lock.release()
    assert client.keys("held:*") == [b"held:fence"]  # the prefix's fence counter stays
