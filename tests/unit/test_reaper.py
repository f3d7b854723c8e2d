"""The reaper's verdicts: which holders count as provably dead, with a fake clock and fake pids."""

from __future__ import annotations

import pytest

from celery_redlock.celery.reaper import (
    PID_GONE,
    WORKER_SILENT,
    SilenceTracker,
    holder_margin,
    judge,
    renewal_overdue,
)
from celery_redlock.core.holder import Holder
from celery_redlock.core.inventory import LockInfo, PermitInfo
from celery_redlock.core.lease import Lease

NODE, HOST = "w1@box", "box"
KEY = "redlock:v1:{app.t:" + "0" * 64 + "}"


def lock(*, node=NODE, host=HOST, pid=4242, ttl_ms=60_000, left=59.0, key=KEY) -> LockInfo:
    holder = Holder(
        task_id="t-1", hostname=node, pid=pid, token="x", acquired_ms=1, ttl_ms=ttl_ms, host=host
    )
    return LockInfo(key, "app.t", holder.encode(), holder, left, 7, 1000.0)


def verdict(info, *, alive=(), silent=None, after=60.0):
    return judge(
        info,
        node=NODE,
        host=HOST,
        silent_for=lambda node: silent,
        unresponsive_after=after,
        alive=lambda pid: pid in alive,
    )


def test_own_pool_process_gone_is_reaped_with_its_pid_in_the_evidence():
    """A lock of this worker, on this host, whose pid is gone: released, saying which pid."""
    found = verdict(lock())
    assert found is not None and found.reason == PID_GONE
    assert "4242" in found.evidence and NODE in found.evidence
    assert found.max_pttl_ms == -1


def test_own_live_process_keeps_its_lock():
    """A lock of this worker whose pid runs is never released, however old its TTL."""
    assert verdict(lock(left=1.0), alive={4242}, silent=1e9, after=0.001) is None


def test_pid_is_only_evidence_for_this_worker_on_this_host():
    """Same node name on another host, or another node on this host: the pid proves nothing."""
    assert verdict(lock(host="elsewhere")) is None
    assert verdict(lock(node="w2@box")) is None


def test_silent_worker_needs_both_silence_and_stopped_renewals():
    """Another worker's lock goes only when it was silent long enough AND its renewals stopped
    that long ago: at most half its TTL less the silence limit is left."""
    other = {"node": "w2@far", "host": "far"}
    fresh = lock(**other, left=50.0)  # renewed 10 s ago: its holder renews
    overdue = lock(**other, left=20.0)  # last renewed 40 s ago, due every 20 s
    assert verdict(fresh, silent=1e9, after=10.0) is None
    assert verdict(overdue, silent=None, after=10.0) is None  # answered the latest ping
    assert verdict(overdue, silent=9.0, after=10.0) is None  # not silent long enough
    # Overdue, but not by the silence limit yet: its holder may still count it valid.
    assert verdict(lock(**other, left=25.0), silent=1e9, after=10.0) is None
    found = verdict(overdue, silent=11.0, after=10.0)
    assert found is not None and found.reason == WORKER_SILENT
    assert found.max_pttl_ms == 20_000  # the script checks again, on every master
    assert "w2@far" in found.evidence and "11.0s" in found.evidence


def test_a_ttl_of_at_most_twice_the_silence_limit_is_left_to_expire():
    """Such a lock would expire before the rule could apply: it never does."""
    other = {"node": "w2@far", "host": "far"}
    assert verdict(lock(**other, left=0.5), silent=1e9, after=30.0) is None


def test_values_without_host_ttl_or_holder_are_never_judged():
    """v1 values, TTL-less values (reservations, plain locks) and reservations stay."""
    v1 = Holder.parse("v1|tok|t-1|w1@box|4242")
    assert v1 is not None
    assert verdict(LockInfo(KEY, "app.t", "v1|tok|t-1|w1@box|4242", v1, 1.0, 1, 0.0)) is None
    assert verdict(lock(ttl_ms=0)) is None
    assert verdict(lock(key=KEY + ":queued")) is None
    assert verdict(LockInfo(KEY, "app.t", "foreign", None, 1.0, 1, 0.0)) is None


@pytest.mark.parametrize(
    ("left", "overdue"), [(59.0, False), (40.0, False), (30.1, False), (29.9, True)]
)
def test_renewal_is_overdue_below_half_the_ttl(left, overdue):
    """The watchdog renews every third of the TTL; half of it left means a renewal was missed."""
    assert renewal_overdue(lock(left=left)) is overdue


def test_silence_is_measured_from_the_first_unanswered_ping():
    """Silence starts at the first missed ping, ends with an answer, is forgotten when unused."""
    now = [100.0]
    tracker = SilenceTracker(clock=lambda: now[0])
    tracker.heard(["a", "b"], answered=["b"])
    now[0] = 130.0
    tracker.heard(["a", "b"], answered=[])
    assert tracker.silent_for("a") == 30.0
    assert tracker.silent_for("b") == 0.0
    tracker.heard(["a"], answered=["a"])
    assert tracker.silent_for("a") is None
    tracker.forget_except(["a"])
    assert tracker.silent_for("b") is None


def permit(*, node=NODE, host=HOST, pid=4242, left=59.0) -> PermitInfo:
    holder = Holder(
        task_id="t-2", hostname=node, pid=pid, token="y", acquired_ms=1, ttl_ms=60_000, host=host
    )
    return PermitInfo(f"1|9|{holder.encode()}", 1, 9, holder.encode(), holder, left)


def test_a_permit_is_judged_on_its_own_holder_by_the_rules_of_a_lock():
    """A permit of this worker whose pid is gone goes; one whose pid runs stays; another
    worker's permit goes only when that worker is silent AND the permit's own TTL is overdue."""
    found = verdict(permit())
    assert found is not None and found.reason == PID_GONE and "4242" in found.evidence
    assert verdict(permit(), alive={4242}) is None
    assert verdict(permit(host="elsewhere")) is None
    other = {"node": "w2@far", "host": "far"}
    assert verdict(permit(**other, left=50.0), silent=1e9, after=10.0) is None
    assert verdict(permit(**other, left=20.0), silent=None, after=10.0) is None
    found = verdict(permit(**other, left=20.0), silent=11.0, after=10.0)
    assert found is not None and found.reason == WORKER_SILENT
    assert found.max_pttl_ms == 20_000 and "the permit was last renewed 40.0s ago" in found.evidence
    # The semaphore's own entry names no holder: only its permits are judged.
    assert verdict(LockInfo(KEY, "app.t", "", None, 1.0, 9, 1000.0, permits=(permit(),))) is None


@pytest.mark.parametrize(
    ("ttl", "silence", "margin"),
    [(10.0, 60.0, 0.0), (120.0, 60.0, 0.0), (121.0, 60.0, 0.5), (600.0, 60.0, 240.0)],
)
def test_a_holder_leaves_the_reaper_what_its_ttl_exceeds_twice_the_silence(ttl, silence, margin):
    """The worker-silent rule releases no sooner than the silence after half the TTL."""
    assert holder_margin(ttl, silence) == margin


def test_a_lease_left_to_the_reaper_keeps_the_margin_through_renewals():
    """Acquired and renewed alike, the lease ends ``margin`` before the TTL would."""
    now = [100.0]
    lease = Lease(client=None, name="k", token=b"t", fence=1, ttl=600, sent_at=now[0],
                  clock=lambda: now[0], drift_factor=0.0)  # fmt: skip
    full = lease.remaining()
    lease.leave_to_reaper(240.0)
    assert lease.remaining() == pytest.approx(full - 240.0)
    now[0] = 300.0
    lease.validate_until(300.0, 600.0)  # a renewal granting the whole TTL again
    assert lease.remaining() == pytest.approx(full - 240.0)
    now[0] = 300.0 + full - 240.0
    assert lease.lost
