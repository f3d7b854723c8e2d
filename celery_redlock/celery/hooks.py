"""Celery signal handlers: clean up after pool processes the worker killed itself.

``revoke(terminate=True, signal="SIGKILL")`` kills the pool process running
a task, so the task cannot release its lock; without help the lock would
outlive it by up to ``lock_ttl``. The main process knows which task and worker
the killed process ran, and the lock's value names both, so it deletes the
lock if, and only if, it still names them (under ``lock_limit``, the permit
that names them). (With the default SIGTERM the task unwinds and releases the
lock itself, and its cleanup code may still be running: nothing is deleted
from outside then.)
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from celery import signals
from redis.exceptions import RedisError

from celery_redlock.celery.settings import GUARDED_ATTRIBUTE
from celery_redlock.core.error_text import describe_error
from celery_redlock.core.holder import Holder

from .guards import guard_for
from .queues import QueueLocks, registered
from .window import release_revoked

__all__ = ["connect"]

logger = logging.getLogger(__name__)


def connect() -> None:
    """Connect the handlers (once per process; later calls do nothing)."""
    signals.task_revoked.connect(
        _release_killed, weak=False, dispatch_uid="celery-redlock-release-killed"
    )
    signals.task_revoked.connect(
        _release_reservation, weak=False, dispatch_uid="celery-redlock-release-reservation"
    )


def _release_reservation(
    sender: Any = None, request: Any = None, terminated: bool = False, **kwargs: Any
) -> None:
    # A revoked or expired message discarded before it ran: its enqueue lock
    # would otherwise keep every later call out until it expires.
    if terminated or request is None or sender is None:
        return
    if not getattr(sender, GUARDED_ATTRIBUTE, False):
        return
    try:
        release_revoked(sender, guard_for(sender), request)
    except Exception as exc:  # a handler must not take the worker down
        logger.warning(
            "task %s[%s]: could not release the enqueue lock of a revoked task: %s",
            sender.name,
            request.id,
            describe_error(exc),
        )


def _release_killed(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    signum: Any = None,
    **kwargs: Any,
) -> None:
    if not terminated or request is None or sender is None or int(signum or 0) != signal.SIGKILL:
        return
    task = sender
    locks: QueueLocks | None = registered(task.app)
    queue = locks.queue_of(request.delivery_info) if locks is not None else None
    if queue is None and not getattr(task, GUARDED_ATTRIBUTE, False):
        return  # a plain task from an unlocked queue holds no lock
    guard = guard_for(task, queue, locks.locked[queue] if locks and queue else None)
    try:
        key = guard.keys.key_for(request.args or (), request.kwargs or {})
        fragment = Holder.fragment(request.id, request.hostname)
        released = guard.store.release_held_by(key, fragment, limit=guard.options.limit)
    except Exception as exc:  # a handler must not take the worker down
        level = logging.WARNING if isinstance(exc, RedisError) else logging.ERROR
        logger.log(
            level,
            "task %s[%s]: could not release the lock of its killed process: %s",
            task.name,
            request.id,
            describe_error(exc),
        )
        return
    if released:
        logger.info("task %s[%s] was killed; released its lock %s", task.name, request.id, key)
