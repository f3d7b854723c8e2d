"""A lock's attempt in line: the :data:`~celery_redlock.core.queue_scripts.FAIR_ACQUIRE` round trip.

Kept beside :class:`~celery_redlock.core.lock.Lock`, which calls it for
``acquire(place=...)``; the wait list itself is described in
:mod:`celery_redlock.core.queue_scripts`.
"""

from __future__ import annotations

from typing import Any

from .lease import Lease
from .queue_scripts import FAIR_ACQUIRE, LEAVE_LINE, Place, queue_keys

__all__ = ["attempt_in_line", "leave_line"]


def attempt_in_line(lock: Any, token: bytes, place: Place, plain: bool) -> bool:
    """Make one attempt of ``lock`` (a ``Lock``) in line; on success store its lease.

    Locks that take their key their own way (``plain`` is false: a subclass's
    ``do_acquire``; ``min_replicas``; no fencing) and locks with a ``bytes``
    name (the line's keys are named from a ``str``) are not queued: they make
    their usual attempt.
    """
    local = lock.local
    local.place = None
    queued = plain and lock.replication is None and lock.fencing
    if not queued or isinstance(lock.name, bytes):
        return bool(lock.do_acquire(token))
    sent_at = lock._clock()
    keys = (lock.name, lock.fence_key, *queue_keys(lock.name))
    args = (token, lock._ttl_ms, lock._fence_retention_ms, "0", "0", *place.args())
    reply = FAIR_ACQUIRE(lock.redis, keys, args)
    if isinstance(reply, list):
        holder_ttl_ms, holder, rank, queued, arrival, now_ms = reply
        local.holder = (
            holder.decode("utf-8", "replace") if isinstance(holder, bytes) else holder,
            holder_ttl_ms / 1000 if holder_ttl_ms >= 0 else None,
        )
        local.place = (int(rank), int(queued), int(float(arrival)), int(now_ms))
        return False
    local.holder = None
    local.lease = lock._new_lease(Lease, lock.redis, token, int(reply), sent_at)
    return True


def leave_line(client: Any, name: str, member: str) -> bool:
    """Take ``member`` out of the wait line of ``name`` (a call that will not come back).

    One round trip; returns whether it was in line.
    """
    return bool(LEAVE_LINE(client, queue_keys(name), (member,)))
