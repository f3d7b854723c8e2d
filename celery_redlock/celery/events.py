"""The guard's lock events: counted by in-process hooks, sent as signals to connected receivers.

The worker's own counters (:mod:`~celery_redlock.celery.stats`,
:mod:`~celery_redlock.celery.metrics`) register :class:`Counters` hooks with
:func:`count_with`; the guard reports each event through a ``send_*``
function here, which calls the hooks directly and dispatches the public
signal (:mod:`~celery_redlock.celery.signals`) only while a receiver is
connected. Celery's ``Signal.send`` with the counters as receivers cost more
than the counting itself, and every task sends two events.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .signals import lock_acquired, lock_contended, lock_lost, lock_released

__all__ = [
    "Counters",
    "count_with",
    "send_acquired",
    "send_contended",
    "send_lost",
    "send_released",
]

logger = logging.getLogger(__name__)


class Counters:
    """The in-process hooks of one set of built-in counters; a hook left ``None`` is not called.

    Attributes:
        acquired: ``(task, started, waited)`` once a call holds its lock: ``started``
            is the ``time.monotonic()`` at which its run began (``None``: unknown),
            ``waited`` as in :data:`lock_acquired`.
        contended: ``(task, action, line)`` when another call holds it.
        released: ``(task, owned)`` after the release.
        lost: ``(task,)`` when the watchdog finds the lock lost.
    """

    __slots__ = ("acquired", "contended", "lost", "released")

    def __init__(
        self,
        acquired: Callable[[Any, float | None, float | None], None] | None = None,
        contended: Callable[[Any, str, int | None], None] | None = None,
        released: Callable[[Any, bool], None] | None = None,
        lost: Callable[[Any], None] | None = None,
    ) -> None:
        self.acquired = acquired
        self.contended = contended
        self.released = released
        self.lost = lost


# One list per event, of the hooks registered for it: the guard walks a list,
# so an event no counter wants costs a loop over nothing.
_acquired: list[Callable[[Any, float | None, float | None], None]] = []
_contended: list[Callable[[Any, str, int | None], None]] = []
_released: list[Callable[[Any, bool], None]] = []
_lost: list[Callable[[Any], None]] = []


def count_with(counters: Counters) -> None:
    """Call ``counters``' hooks on every lock event in this process (again: no change).

    A process's forks inherit the registration, as they would a receiver.
    """
    if counters.acquired is not None and counters.acquired not in _acquired:
        _acquired.append(counters.acquired)
    if counters.contended is not None and counters.contended not in _contended:
        _contended.append(counters.contended)
    if counters.released is not None and counters.released not in _released:
        _released.append(counters.released)
    if counters.lost is not None and counters.lost not in _lost:
        _lost.append(counters.lost)


def _hook_failed(event: str) -> None:
    # A counter that raises must not fail the task, as a receiver that raises does not.
    logger.exception("celery-redlock counter for %s failed", event)


def send_acquired(
    task: Any,
    task_id: Any,
    key: str,
    fence: int | None,
    ttl: float,
    waited: float | None,
    started: float | None = None,
) -> None:
    """Count an acquisition, and send :data:`lock_acquired` if a receiver is connected.

    ``started``: the ``time.monotonic()`` at which the call's run began, for the
    lock wait the metrics measure (not part of the signal).
    """
    try:
        for hook in _acquired:
            hook(task, started, waited)
    except Exception:
        _hook_failed("lock_acquired")
    # Signal.receivers is the live list connect and disconnect edit: a receiver
    # connected at any time is seen by the next event.
    if lock_acquired.receivers:
        lock_acquired.send(
            sender=task, task_id=task_id, key=key, fence=fence, ttl=ttl, waited=waited
        )


def send_contended(
    task: Any,
    task_id: Any,
    key: str,
    holder: str | None,
    action: str,
    attempt: int,
    line: int | None,
) -> None:
    """Count a conflict, and send :data:`lock_contended` if a receiver is connected."""
    try:
        for hook in _contended:
            hook(task, action, line)
    except Exception:
        _hook_failed("lock_contended")
    if lock_contended.receivers:
        lock_contended.send(
            sender=task,
            task_id=task_id,
            key=key,
            holder=holder,
            action=action,
            attempt=attempt,
            line=line,
        )


def send_released(task: Any, task_id: Any, key: str, fence: int | None, owned: bool) -> None:
    """Count a release, and send :data:`lock_released` if a receiver is connected."""
    try:
        for hook in _released:
            hook(task, owned)
    except Exception:
        _hook_failed("lock_released")
    if lock_released.receivers:
        lock_released.send(sender=task, task_id=task_id, key=key, fence=fence, owned=owned)


def send_lost(task: Any, task_id: Any, key: str, fence: int | None, reason: Any) -> None:
    """Count a lost lock, and send :data:`lock_lost` if a receiver is connected."""
    try:
        for hook in _lost:
            hook(task)
    except Exception:
        _hook_failed("lock_lost")
    if lock_lost.receivers:
        lock_lost.send(sender=task, task_id=task_id, key=key, fence=fence, reason=reason)
