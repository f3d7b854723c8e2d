"""Free a lock or a semaphore permit exactly as the inventory read it, and nothing else.

What :func:`~celery_redlock.core.inventory.find_locks` reads may change before
it is acted on: the holder releases, an acquire reclaims an expired permit and
grants the slot to someone else, the holder renews. Each function here is one
compare-and-delete of the value or permit read, optionally only while its TTL
is still short enough to show that its renewals stopped, so whatever changed
meanwhile is left alone. The reaper, stale-lock recovery at worker start and
the ``celery redlock`` commands use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .inventory import LockInfo, PermitInfo
from .lua import Arg, Script
from .semaphore_scripts import RELEASE_PERMIT, semaphore_keys

__all__ = ["REAP", "delete_permit", "reap_lock"]


def _never_resend(args: Sequence[Arg]) -> None:
    # A second run after a lost reply finds the key gone and answers 0: the
    # caller would report a deleted lock as kept. Its next read looks again.
    return None


# Delete a lock held by a dead holder: only the value read, and only while its
# TTL is still past the renewal deadline, so a holder that renewed meanwhile
# (it was alive after all) keeps its lock.
#
# KEYS[1]  lock key
# ARGV[1]  the value read
# ARGV[2]  the most PTTL (ms) the lock may have left to be deleted; "-1": any
# Returns  1 when the lock was deleted, 0 otherwise. Not resent after a lost reply.
REAP = Script(
    "reap",
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local limit = tonumber(ARGV[2])
if limit >= 0 and redis.call('PTTL', KEYS[1]) > limit then
  return 0
end
return redis.call('DEL', KEYS[1])
""",
    resend=_never_resend,
)


# RELEASE_PERMIT (see semaphore_scripts), never resent after a lost reply: a
# resend counts a missing permit as removed, so a permit its holder released
# meanwhile would be reported (and counted) as reclaimed.
_RECLAIM_PERMIT = Script("reclaim_permit", RELEASE_PERMIT.source, resend=_never_resend)


def reap_lock(client: Any, info: LockInfo, max_pttl_ms: int = -1) -> bool:
    """Delete lock ``info`` if it still holds the value read; ``True`` if it did.

    Args:
        client: The Redis (one master of a Redlock store) the lock was read from.
        info: The lock as read.
        max_pttl_ms: The most PTTL the lock may have left to be deleted (-1: any).

    Raises:
        redis.exceptions.RedisError: When the store fails.
    """
    return bool(REAP(client, (info.key,), (info.value, str(max_pttl_ms))))


def delete_permit(client: Any, info: LockInfo, permit: PermitInfo, max_left_ms: int = -1) -> bool:
    """Remove exactly ``permit`` from semaphore ``info``; ``True`` if it was still held.

    A permit released meanwhile, or reclaimed and granted again (a new member:
    another fence), is not touched, nor are the semaphore's other permits.
    It is not sent again after a lost reply (the ``ConnectionError`` is
    raised): a second send could not tell a permit this one removed from one
    its holder released.

    Args:
        client: The Redis the semaphore was read from.
        info: The semaphore as read.
        permit: One of ``info.permits``.
        max_left_ms: The most milliseconds the permit may have left to be
            removed (-1: any); one renewed since it was read has more.

    Raises:
        redis.exceptions.RedisError: When the store fails.
    """
    keys = semaphore_keys(info.key)
    args = (
        permit.member,
        "0",
        max(1, int(permit.ttl * 1000)),
        len(info.permits or ()),
        str(max_left_ms),
    )
    return bool(_RECLAIM_PERMIT(client, (keys.permits, keys.waiters, keys.wake), args))
