"""A requeued task's place in its key's wait line: built from its message, carried in its headers.

Under ``lock_on_conflict="requeue"`` (and ``lock_fair``, the default) every
attempt of a call takes its lock in line (see
:mod:`celery_redlock.core.queue_scripts`): the oldest waiter of a key is
admitted first when the key frees. The call's first arrival travels in the
``x_redlock_queue`` header of each requeue, so its place survives requeues,
redeliveries and a lapsed entry; the rank it saw last lets the next refusal
judge how fast the line moves (:func:`~celery_redlock.calls.decisions.fair_countdown`).
"""

from __future__ import annotations

import time
from typing import Any

from celery_redlock.calls.decisions import NEXT_POLL, Decision
from celery_redlock.calls.options import LockOptions, Mode, OnConflict
from celery_redlock.core.holder import Refusal
from celery_redlock.core.queue_scripts import Place

from .messages import place_of

__all__ = ["GRACE", "in_line", "line_header", "place_for", "waited"]

#: Seconds a requeued call may take, beyond its countdown, to be run again by a
#: busy worker while it still counts as present in line.
GRACE = 1.0


def in_line(options: LockOptions) -> bool:
    """Whether the calls of a task with ``options`` take their lock in line."""
    return bool(
        options.fair
        and options.on_conflict == OnConflict.REQUEUE
        and options.mode == Mode.WHILE_EXECUTING
    )


def place_for(request: Any, options: LockOptions) -> Place | None:
    """The place of the running request's call, or ``None`` for one that cannot be requeued.

    After each attempt the call counts as present for the poll of a call that
    is next plus :data:`GRACE` (a busy worker's delay): a free key waits for
    an older waiter only while that one is present. Its entry lasts
    ``requeue_max_delay`` plus the lock's TTL (at least :data:`GRACE`); a call
    gone for longer (revoked, expired, lost) gives up its place.
    """
    if request.is_eager or request.id is None:
        return None
    seen = place_of(request)
    return Place(
        str(request.id),
        seen[0] if seen is not None else None,
        int((min(NEXT_POLL, options.requeue_delay / 4) + GRACE) * 1000),
        int((options.requeue_max_delay + max(options.ttl, GRACE)) * 1000),
    )


def line_header(request: Any, refusal: Refusal, decision: Decision) -> list[int] | None:
    """The ``x_redlock_queue`` header of a requeue after ``refusal`` (``None``: not in line).

    A copy meeting its own earlier delivery's lock (``decision.own``) takes the
    place that delivery had: its arrival is no later than when that delivery
    took the lock.
    """
    holder = refusal.holder
    arrivals = [refusal.arrival_us] if refusal.rank is not None else []
    if decision.own and holder is not None and holder.acquired_ms:
        # (A semaphore does not put a copy meeting its own permit in line.)
        arrivals.append(holder.acquired_ms * 1000)
    known = [arrival for arrival in arrivals if arrival is not None]
    if not known or refusal.now_ms is None:
        return None
    return [request.retries or 0, min(known), refusal.rank or 0, refusal.now_ms]


def seen_in_line(request: Any) -> tuple[int, int] | None:
    """The rank and server ms of this call's previous refusal in line, if any."""
    seen = place_of(request)
    return (seen[1], seen[2]) if seen is not None else None


def waited(place: Place | None) -> float | None:
    """Seconds a call admitted in line waited since it first joined (``None``: never waited)."""
    if place is None or place.arrival_us is None:
        return None
    return max(0.0, time.time() - place.arrival_us / 1_000_000)
