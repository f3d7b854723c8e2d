"""``extend()`` and ``reacquire()`` of the asyncio lock: one renew round trip each.

:class:`ExtendableLock` sits between :class:`~celery_redlock.asyncio.task_state.PerTaskLock`
and :class:`~celery_redlock.asyncio.release.ReleasableLock`, the base of the
asyncio ``Lock`` and ``Semaphore``; a Redlock replaces
:meth:`ExtendableLock._send_renew` with its quorum vote.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Literal

from celery_redlock.core.hold import LOCK, check_renewable
from celery_redlock.core.lease import Lease
from celery_redlock.core.lock_options import Number, positive_seconds
from celery_redlock.core.scripts import RENEW

from .scripts import run_script
from .task_state import PerTaskLock, TaskState

__all__ = ["ExtendableLock"]


class ExtendableLock(PerTaskLock):
    """A per-task lock whose hold can be extended or reset to its full TTL."""

    def extend(
        self, additional_time: Number, replace_ttl: bool = False
    ) -> Coroutine[Any, Any, Literal[True]]:
        """Add ``additional_time`` seconds to the TTL left, or set the TTL to it.

        Raises:
            LockError: If this task does not hold the lock, or it has no timeout.
            ConfigurationError: If ``additional_time`` is not positive.
            LockNotOwned: If the lock was lost meanwhile.
        """
        return self._extend(self._bound(), additional_time, replace_ttl)

    async def _extend(
        self, state: TaskState | None, additional_time: Number, replace_ttl: bool
    ) -> Literal[True]:
        state = state or self._state()
        check_renewable(self.name, state.token, self.timeout, "extend")
        positive_seconds("additional_time", additional_time, allow_none=False)
        await self._renew(state, int(additional_time * 1000), replace_ttl, "extend")
        return True

    def reacquire(self) -> Coroutine[Any, Any, Literal[True]]:
        """Reset the lock's TTL to ``timeout``.

        Raises:
            LockError: If this task does not hold the lock, or it has no timeout.
            LockNotOwned: If the lock was lost meanwhile.
        """
        return self._reacquire(self._bound())

    async def _reacquire(self, state: TaskState | None) -> Literal[True]:
        state = state or self._state()
        check_renewable(self.name, state.token, self.timeout, "reacquire")
        await self._renew(state, self._ttl_ms, True, "reacquire")
        return True

    async def _renew(self, state: TaskState, ms: int, replace: bool, operation: str) -> None:
        lease, token = state.lease, state.token
        assert lease is not None and token is not None
        sent_at = self._clock()
        pttl_ms = await self._send_renew(lease, ms, replace)
        if not pttl_ms:
            # The lock's words, for the semaphore too: its extend() has always said so.
            raise LOCK.lost(lease, operation, self.name)
        lease.validate_until(sent_at, pttl_ms / 1000)

    async def _send_renew(self, lease: Lease, ms: int, replace: bool) -> int:
        """One renew round trip: the new TTL in ms, or 0 if the lock is not ours."""
        (pttl_ms,) = await run_script(
            RENEW, self.redis, (self.name,), ("1" if replace else "0", lease.token, ms)
        )
        return int(pttl_ms)
