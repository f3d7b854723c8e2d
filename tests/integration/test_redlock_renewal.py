"""Auto-renewed and lost Redlocks: renewal by quorum, loss reported, others' keys untouched."""

from __future__ import annotations

import threading
import time

import pytest

from celery_redlock import Lock, LockNotOwned, Redlock, Watchdog
from tests.integration.test_redlock import wait_until, warm


@pytest.mark.timeout(30)
def test_auto_renew_keeps_a_one_second_redlock_for_four_seconds(redis_servers):
    """A 1 s Redlock with auto_renew stays on a majority of masters for 4 s without a gap."""
    servers = redis_servers(5)
    clients = [s.client() for s in servers]
    lock = Redlock(clients, "long", timeout=1, auto_renew=True, watchdog=Watchdog())
    assert lock.acquire(blocking=False)
    samples = []
    until = time.monotonic() + 4
    while time.monotonic() < until:
        holding = [c.get("long") == lock.token and c.pttl("long") > 0 for c in clients]
        samples.append(sum(holding))
        time.sleep(0.05)
    assert min(samples) >= 3, samples
    assert not lock.lost and lock.lease.renewals >= 9
    rival = Redlock([s.url for s in servers], "long", timeout=1)
    assert not rival.acquire(blocking=False)
    lock.release()
    assert rival.acquire(blocking=False)
    rival.release()


@pytest.mark.timeout(30)
def test_one_watchdog_renews_single_server_and_redlock_leases(redis_servers):
    """The watchdog keeps batching single-server locks while it renews a Redlock on its own."""
    servers = redis_servers(3)
    watchdog = Watchdog()
    single = Lock(servers[0].client(), "single", timeout=1, auto_renew=True, watchdog=watchdog)
    multi = Redlock([s.client() for s in servers], "multi", timeout=1, auto_renew=True,
                    watchdog=watchdog)  # fmt: skip
    assert single.acquire(blocking=False)
    assert multi.acquire(blocking=False)
    # Five renewals at a third of the TTL span well past the 1 s TTL.
    assert wait_until(lambda: single.lease.renewals >= 5 and multi.lease.renewals >= 5, timeout=10)
    assert single.owned() and multi.owned()
    single.release()
    multi.release()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        # Renewals short of a majority are retried until the validity runs out.
        ("kill", "validity"),
        # A majority answering "not ours" loses the lease at the next renewal.
        ("restart", "not owned"),
    ],
)
def test_majority_lost_during_renewal_marks_the_lease_lost(redis_servers, failure, reason):
    """Losing a majority of masters while auto-renewed reports the lease lost within its TTL."""
    servers = redis_servers(5)
    lost = threading.Event()
    past_deadline: list[bool] = []

    def on_lost(lease):
        past_deadline.append(lease.deadline <= time.monotonic())
        lost.set()

    lock = Redlock([s.client() for s in servers], "renewed", timeout=1, auto_renew=True,
                   on_lost=on_lost, watchdog=Watchdog())  # fmt: skip
    warm(lock)
    assert lock.acquire(blocking=False)
    for server in servers[:3]:
        getattr(server, failure)()
    # A window of ten TTLs: the watchdog reports the loss, it does not keep trying.
    assert lost.wait(10)
    # Masters that are down cost the lease its validity, no more, no less;
    # masters that say "not ours" cost it at once, before its deadline.
    assert past_deadline == [reason == "validity"]
    assert lock.lost
    assert reason in lock.lease.loss_reason
    with pytest.raises(LockNotOwned):
        lock.release()
    # Whatever the cause, the masters left hold no key of ours once we know it is lost.
    survivors = [s.client() for s in servers[3:]]
    assert wait_until(lambda: all(c.get("renewed") is None for c in survivors))


def test_release_and_extend_of_a_lost_redlock_raise_and_spare_the_new_holder(redis_servers):
    """A holder past its TTL gets LockNotOwned everywhere and deletes nothing of the next."""
    servers = redis_servers(5)
    clients = [s.client() for s in servers]
    # 1 s: long enough that each master's 100 ms share answers on a loaded machine.
    old = Redlock(clients, "job", timeout=1.0)
    warm(old)
    assert old.acquire(blocking=False)
    time.sleep(1.1)
    new = Redlock([s.url for s in servers], "job", timeout=10)
    assert new.acquire(blocking=False)
    held = [c.get("job") for c in clients]
    assert held.count(new.token) >= 3
    with pytest.raises(LockNotOwned):
        old.extend(5)
    with pytest.raises(LockNotOwned):
        old.reacquire()
    with pytest.raises(LockNotOwned):
        old.release()
    assert old.lost
    assert [c.get("job") for c in clients] == held
    assert new.owned()
    new.release()
