"""What the inventory derives from a lock's key, value and PTTL, without a server."""

from __future__ import annotations

from celery_redlock.core.holder import Holder
from celery_redlock.core.inventory import LockInfo, PermitInfo, lock_pattern, parse_key
from celery_redlock.core.keys import KeyBuilder


def _key(prefix: str = "redlock", task: str = "app.sync") -> str:
    return KeyBuilder(task, lambda x: x, None, prefix).key_for((1,), {})


def test_parse_key_reads_prefix_and_task_and_rejects_fence_keys():
    """Lock keys give back their prefix and task; fence and foreign keys give None."""
    key = _key("ops:prefix", "app.sync:v2")
    assert parse_key(key) == ("ops:prefix", "app.sync:v2")
    assert parse_key(key + ":fence") is None
    assert parse_key("redlock:v1:{notahash}") is None


def test_pattern_escapes_glob_characters():
    """A prefix or task name holding glob characters matches only itself."""
    assert lock_pattern("a*b", "t?[x]") == r"a\*b:v1:{t\?\[x\]:*"
    assert lock_pattern("redlock") == "redlock:v1:{*:*"


def _info(acquired_s: float, ttl_left: float | None, now: float, ttl_ms: int = 30_000) -> LockInfo:
    holder = Holder(
        task_id="t",
        hostname="n",
        pid=1,
        token="x",
        acquired_ms=int(acquired_s * 1000),
        ttl_ms=ttl_ms,
        host="h",
        queue=None,
    )
    return LockInfo(
        key=_key(),
        task="app.sync",
        value=holder.encode(),
        holder=holder,
        ttl=ttl_left,
        fence=7,
        server_time=now,
    )


def test_renewals_derive_from_age_and_ttl_left():
    """Each renewal resets the TTL; the count is time to the latest reset over ttl/3."""
    assert _info(1000.0, 25.0, 1005.0).renewals == 0  # 5 s old, 25 s left: never renewed
    renewed_twice = _info(1000.0, 29.0, 1021.0)  # reset 1 s ago, 20 s after acquiring
    assert renewed_twice.renewals == 2
    assert renewed_twice.renewed_at == 1020.0
    assert _info(1000.0, 30.0, 1100.0).renewals == 10


def test_renewals_unknown_without_metadata():
    """A v1 value (no acquisition time or TTL) and a lock without expiry report None."""
    v1 = Holder(task_id="t", hostname="n", pid=1, token="x")
    info = LockInfo(
        key=_key(), task="app.sync", value="v", holder=v1, ttl=5.0, fence=None, server_time=0.0
    )
    assert info.renewals is None and info.acquired_at is None
    assert _info(1000.0, None, 1005.0).renewals is None
    assert _info(1000.0, 5.0, 1005.0, ttl_ms=0).renewals is None


def test_a_semaphores_permits_key_is_read_only_when_asked_for():
    """The permits set of a semaphore parses as its task's key only with semaphores=True,
    so the reaper and recovery, which never ask, see locks only."""
    key = _key("ops", "app.limited") + ":permits"
    assert parse_key(key) is None
    assert parse_key(key, semaphores=True) == ("ops", "app.limited")
    assert parse_key(_key() + ":waiters", semaphores=True) is None


def test_a_permit_member_reads_back_its_slot_fence_holder_and_ttl():
    """A member ``slot|fence|token`` scored by its expiry gives the permit; others give None."""
    holder = Holder.new("t-1", "w@h", ttl=10)
    permit = PermitInfo.parse(f"2|1234|{holder.encode()}", 1_005_500.0, 1000.0)
    assert permit is not None
    assert (permit.slot, permit.fence, permit.ttl) == (2, 1234, 5.5)
    assert permit.holder == holder
    assert permit.as_dict()["token"] == holder.token
    foreign = PermitInfo.parse("0|7|plain-token", 1_001_000.0, 1000.0)
    assert foreign is not None and foreign.holder is None and foreign.token == "plain-token"
    assert PermitInfo.parse("not-a-permit", 1.0, 0.0) is None
