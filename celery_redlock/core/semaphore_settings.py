"""What the semaphore and its asyncio twin share: a limit, keys, and the steps around a round trip.

:class:`SemaphoreSettings` adds a semaphore's limit and keys to the options
every lock class takes (:class:`~celery_redlock.core.lock_options.LockSettings`),
and does the parts of an acquire that need no I/O: reading its arguments,
turning a permit ``ACQUIRE_PERMIT`` granted into a :class:`PermitLease`, the
error of a ``with`` block that got none. The round trips stay in
:mod:`celery_redlock.core.semaphore` and :mod:`celery_redlock.asyncio.semaphore`.
"""

from __future__ import annotations

import secrets
from typing import Any

from .exceptions import LockError, LockNotAcquired
from .fences import is_cluster
from .holder import Holder, Refusal
from .lock_options import LockSettings, Number, positive_seconds
from .permit import WAIT_SLACK, PermitLease, check_limit
from .semaphore_scripts import SemaphoreKeys, semaphore_keys

__all__ = ["SemaphoreSettings"]


class SemaphoreSettings(LockSettings):
    """A semaphore's options (sync and asyncio), checked and stored once."""

    limit: int
    keys: SemaphoreKeys

    def _check_limit(self, limit: object, timeout: object) -> None:
        """Check the limit, and that permits expire; before the other options are."""
        self.limit = check_limit("limit", limit)
        positive_seconds("timeout", timeout, allow_none=False)

    def _name_keys(self) -> None:
        """Name the semaphore's keys, once ``redis`` and ``name`` are configured."""
        self.keys = keys = semaphore_keys(self.name, cluster=is_cluster(self.redis))
        self._acquire_keys = (keys.permits, keys.fence, keys.waiters, keys.waiting)
        self._release_keys = (keys.permits, keys.waiters, keys.wake)
        # Waits block on the wake list until a server refuses BLPOP's fractional timeout.
        self._blpop = True

    def _acquire_plan(
        self,
        sleep: Number | None,
        blocking: bool | None,
        blocking_timeout: Number | None,
        token: str | bytes | None,
    ) -> tuple[float, bool, Number | None, bytes, str, int]:
        """Read an acquire's arguments, defaults filled in.

        Returns:
            The longest pause between attempts, whether to block, the longest
            wait (``None``: forever), the token, its task id field (see
            :meth:`Holder.owner_field`), and how long a place on the wait list
            lasts in ms (0: the caller does not wait).
        """
        pause = float(self.sleep if sleep is None else sleep)
        blocking = self.blocking if blocking is None else blocking
        if blocking_timeout is None:
            blocking_timeout = self.blocking_timeout
        if token is None:
            encoded, owner = secrets.token_hex(16).encode(), ""
        else:
            encoded = self._encode(token)
            owner = Holder.owner_field(encoded)
        wait_ms = int((2 * pause + WAIT_SLACK) * 1000) if blocking else 0
        return pause, blocking, blocking_timeout, encoded, owner, wait_ms

    def _encode(self, token: str | bytes) -> bytes:
        encoded: bytes = self.redis.get_encoder().encode(token)
        return encoded

    def _member(self, member: str | bytes) -> bytes:
        """A permit's member as the script answered it, in bytes."""
        return self._encode(member) if isinstance(member, str) else member

    def _permit(self, reply: list[Any], sent_at: float) -> PermitLease:
        """The lease of the permit an ``ACQUIRE_PERMIT`` sent at ``sent_at`` granted."""
        _, fence, slot, member = reply
        return PermitLease(
            slot=int(slot),
            permits_key=self.keys.permits,
            client=self.redis,
            name=self.name,
            token=self._member(member),
            fence=int(fence),
            ttl=self.timeout,
            sent_at=sent_at,
            clock=self._clock,
            drift_factor=self.drift_factor,
            on_lost=self.on_lost,
            owner=self,
            label=self.label,
        )

    def _one_permit_each(self, hold: Any) -> None:
        """Raise if ``hold`` (a thread's or task's, or the shared one) has a live permit.

        A holder takes one permit at a time. A second would replace the first
        in the hold, where no release could reach it and renewal would keep it,
        one of ``limit`` slots gone for good.

        Raises:
            LockError: If the hold's permit is neither released nor lost.
        """
        lease = hold.lease
        if hold.token is not None and lease is not None and not lease.lost:
            raise LockError(
                f"{self.name}: this holder already holds a permit (slot {lease.slot}); "
                "release it before acquiring again"
            )

    def _no_permit(self, refusal: Refusal) -> LockNotAcquired:
        """The error of a ``with`` block that got no permit, naming who held one."""
        return LockNotAcquired(
            f"Unable to acquire a permit of {self.name} within the time specified",
            lock_name=self.name,
            holder=refusal.value,
            holder_ttl=refusal.ttl,
        )

    def __repr__(self) -> str:
        return f"<Semaphore {self.name!r} limit={self.limit} timeout={self.timeout}>"
