"""The generation scripts of the newest-call windows (STAMP, CLAIM, UNSTAMP) on a private server.

The worker-level tests (tests/integration/celery/test_windows.py) show the
windows end to end; these pin the scripts' contracts that those cannot reach
in a bounded time: how long the generation lives, and what a copy finds when
it is gone.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.crc import key_slot

from celery_redlock.core.keys import KeyBuilder
from celery_redlock.core.lock import fence_key_for
from celery_redlock.core.newest import NewestLock, Stamp, generation_key, parse_stamp, stamp

KEY = "t:v1:{task:abc}"


def _draw(r: redis.Redis, call_id: str, keep_for: float = 60.0) -> Stamp:
    return stamp(r, KEY, call_id, debounce=None, max_wait=None, keep_for=keep_for)


def _claim(r: redis.Redis, drawn: Stamp, call_id: str, keep_ms: int = 60_000) -> NewestLock:
    lock = NewestLock(
        r,
        KEY,
        stamp=parse_stamp(drawn.encode()),
        task_id=call_id,
        keep_ms=keep_ms,
        timeout=10,
        blocking=False,
    )
    lock.acquire()
    return lock


def test_every_key_of_a_claim_shares_the_lock_keys_slot() -> None:
    """Cluster: the lock, its slot's fence counter and its generation hash share one slot."""

    def task(document_id: Any, revision: Any) -> None:
        """A task keyed on one argument."""

    key = KeyBuilder("tasks.reindex", task, ["document_id"], "p").key_for((42, 7), {})
    counter = fence_key_for(key, cluster=True)
    slots = {key_slot(k.encode()) for k in (key, counter, generation_key(key))}
    assert len(slots) == 1, key


def test_a_later_call_never_shortens_the_generation_of_an_earlier_one(r: redis.Redis) -> None:
    """A call due in an hour, then one due now: the hour-long copy still finds itself replaced.

    If the second call's STAMP or its CLAIM cut the generation's life down to
    their own, the first copy would come due to an empty hash, stand as the
    newest and run its stale arguments after the newer call.
    """
    early = _draw(r, "A", keep_for=3600)
    late = _draw(r, "B", keep_for=1)
    assert late.replaced == "A"
    assert r.pttl(generation_key(KEY)) > 3_000_000
    newer = _claim(r, late, "B", keep_ms=1000)
    assert newer.locked()
    assert r.pttl(generation_key(KEY)) > 3_000_000
    newer.release()
    older = _claim(r, early, "A")
    assert not older.locked() and older.superseded_by == "B"


def test_a_copy_finding_no_generation_stands_as_the_newest_and_the_newest_wins(
    r: redis.Redis,
) -> None:
    """The store lost the hash: each copy registers in turn; the highest generation runs."""
    first, second = _draw(r, "A"), _draw(r, "B")
    r.delete(generation_key(KEY))
    a = _claim(r, first, "A")
    assert a.recovered and not a.locked()
    b = _claim(r, second, "B")
    assert b.recovered and not b.locked()
    a_again = _claim(r, first, "A")
    assert a_again.superseded_by == "B"
    b_again = _claim(r, second, "B")
    assert b_again.locked()
    b_again.release()


def test_a_copy_of_a_lost_epoch_retires_naming_the_newest(r: redis.Redis) -> None:
    """A message from before the hash was lost meets a newer epoch: superseded, never run."""
    old = _draw(r, "A")
    r.delete(generation_key(KEY))
    new = _draw(r, "B")
    assert new.epoch != old.epoch and new.generation == 1 and new.replaced == ""
    stale = _claim(r, old, "A")
    assert stale.superseded_by == "B" and not stale.locked()


def test_a_lock_reused_reports_only_its_latest_attempt(r: redis.Redis) -> None:
    """Recovered on one attempt, then meeting a running copy: the second refusal is a conflict."""
    drawn = _draw(r, "A")
    r.delete(generation_key(KEY))
    lock = _claim(r, drawn, "A")
    assert lock.recovered
    r.set(KEY, "another copy", px=10_000)
    assert not lock.acquire()
    assert not lock.recovered and lock.superseded_by is None
    assert lock.refusal.value == "another copy"
