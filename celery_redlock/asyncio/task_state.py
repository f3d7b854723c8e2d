"""The asyncio lock's state per task, and what the calling task reads from it.

All tasks of an event loop share one thread, so ``threading.local`` would let
one task release another's hold: :class:`PerTaskLock`, the base of
:class:`~celery_redlock.asyncio.lock.Lock`, keeps a :class:`TaskState` per
task instead (or one shared by all, with ``thread_local=False``), and answers
``lease``, ``token``, ``fence``, ``lost`` and ``remaining()`` for the caller's.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from celery_redlock.core.exceptions import LockError
from celery_redlock.core.holder import Refusal
from celery_redlock.core.lease import Lease
from celery_redlock.core.lock_options import LockSettings

__all__ = ["PerTaskLock", "TaskState"]


class TaskState:
    """What one task knows about its hold of one lock."""

    __slots__ = ("attempts", "failure", "holder", "lease", "refusal", "renewal", "token", "tried")

    def __init__(self) -> None:
        self.token: bytes | None = None
        self.lease: Lease | None = None
        self.holder: tuple[str | None, float | None] | None = None
        # A refusal a subclass reports in full (a semaphore's: how full, how many wait).
        self.refusal: Refusal | None = None
        # Why the latest attempt failed, when a subclass knows more than the holder.
        self.failure: LockError | None = None
        self.renewal: asyncio.Task[None] | None = None
        # The token of the latest attempt, and how many attempts were numbered
        # (for a subclass whose attempts store values of their own).
        self.tried: bytes | None = None
        self.attempts = 1


class PerTaskLock(LockSettings):
    """A lock whose state is kept per asyncio task: the lookup, and the caller's view of it.

    Each method of the lock looks its task up when it is *called*, not when it
    is first awaited, so ``asyncio.wait_for(lock.acquire(), ...)`` (which runs
    the coroutine in a task of its own before Python 3.12) still records the
    hold for the caller.
    """

    def _keep_state_per_task(self) -> None:
        """Start with no state; call once ``thread_local`` is configured."""
        self._shared = None if self.thread_local else TaskState()
        # Per-task states die with their tasks.
        self._states: weakref.WeakKeyDictionary[asyncio.Task[Any], TaskState] = (
            weakref.WeakKeyDictionary()
        )
        # Calls made outside any task (from a loop callback) share one state.
        self._untasked = TaskState()

    def _state(self) -> TaskState:
        """Return the state of the running task (the caller must be on a running loop)."""
        if self._shared is not None:
            return self._shared
        task = asyncio.current_task()
        if task is None:
            return self._untasked
        state = self._states.get(task)
        if state is None:
            state = self._states[task] = TaskState()
        return state

    def _bound(self) -> TaskState | None:
        """The caller's state if a loop runs now; ``None`` defers the lookup to the first await."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        return self._state()

    @property
    def refusal(self) -> Refusal:
        """Who held the key when this task's latest acquire was refused.

        Read it after :meth:`acquire` returned ``False``; after a successful
        acquire it says nothing (both fields ``None``).
        """
        state = self._state()
        return state.refusal or Refusal.of(state.holder)

    @property
    def local(self) -> TaskState:
        """The calling task's state (``token``, ``lease``, ``holder``), as redis-py's ``local``."""
        return self._state()

    @property
    def lease(self) -> Lease | None:
        """This task's latest lease: held, lost or released; ``None`` before any."""
        return self._state().lease

    @property
    def token(self) -> bytes | None:
        """This task's token (the value stored) while it holds the lock, else ``None``."""
        return self._state().token

    @property
    def fence(self) -> int | None:
        """The fencing token of this task's current hold, else ``None``."""
        state = self._state()
        lease = state.lease
        return lease.fence if lease is not None and state.token is not None else None

    @property
    def lost(self) -> bool:
        """``True`` if this task's hold is known lost or has outlived its validity."""
        lease = self._state().lease
        if lease is None or lease.released:
            return lease is not None and lease.lost
        return lease.lost or lease.remaining() <= 0.0

    def remaining(self) -> float:
        """Seconds of validity left to this task's hold (``inf`` without a timeout)."""
        state = self._state()
        if state.lease is None or state.token is None:
            return 0.0
        return state.lease.remaining()
