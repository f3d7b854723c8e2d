"""What the lock and the semaphore share about one hold: its words, its release, its renewal.

:class:`Wording` names a kind of hold in errors and log lines (a lock is
*owned*, a permit *held*), for the sync classes and their asyncio twins alike;
:func:`lock_not_acquired` and :func:`check_renewable` are the sync and asyncio
lock's common errors.
:class:`PerThreadLock` is the sync classes' common base: per-thread state, the
``with`` block's exit, ``release`` with the lease's bookkeeping, and the
renewal's check of the server's answer; each class keeps only its own round
trips (``do_release``, ``_send_renew``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar

from .exceptions import LockError, LockNotAcquired, LockNotOwned
from .lease import Lease
from .lock_options import LockSettings
from .lock_state import LockState, SharedState, ThreadState

if TYPE_CHECKING:
    from .renewal import Watchdog

__all__ = ["LOCK", "PERMIT", "PerThreadLock", "Wording", "check_renewable", "lock_not_acquired"]


@dataclass(frozen=True)
class Wording:
    """How errors and log lines name one kind of hold.

    Attributes:
        noun: What is held (``"lock"``).
        owned: What holding it is called (``"owned"``).
        subject: The hold in a log line, ``%s`` standing for its name.
        unheld: The message of a release without a hold.
    """

    noun: str
    owned: str
    subject: str
    unheld: str

    def lost(self, lease: Lease, operation: str, name: str) -> LockNotOwned:
        """Mark ``lease`` lost, found so by ``operation``; return the error to raise."""
        lease.mark_lost(f"not {self.owned} at {operation}")
        return LockNotOwned(
            f"Cannot {operation} a {self.noun} that's no longer {self.owned}", lock_name=name
        )

    def lost_at_release(self, lease: Lease | None, name: str) -> LockNotOwned:
        """Flag ``lease`` lost at its release (its callback dropped by then); return the error."""
        if lease is not None:
            lease.lost = True
            lease.loss_reason = f"not {self.owned} at release"
        return LockNotOwned(
            f"Cannot release a {self.noun} that's no longer {self.owned}", lock_name=name
        )


#: A lock's words.
LOCK = Wording(
    "lock", "owned", "lock %s", "Cannot release a lock that's not owned or is already unlocked."
)
#: A semaphore permit's words.
PERMIT = Wording("permit", "held", "permit of %s", "Cannot release a permit that's not held.")


def lock_not_acquired(name: str, holder: tuple[str | None, float | None] | None) -> LockError:
    """The error of a ``with`` block that could not take lock ``name``, naming its holder."""
    value, ttl = holder or (None, None)
    return LockNotAcquired(
        "Unable to acquire lock within the time specified",
        lock_name=name,
        holder=value,
        holder_ttl=ttl,
    )


def check_renewable(name: str, token: bytes | None, timeout: float | None, operation: str) -> None:
    """Refuse to extend or reacquire lock ``name`` unless held (``token``) and expiring.

    Raises:
        LockError: If it is not held, or has no timeout.
    """
    if token is None:
        raise LockError(f"Cannot {operation} an unlocked lock", lock_name=name)
    if timeout is None:
        raise LockError(f"Cannot {operation} a lock with no timeout", lock_name=name)


class PerThreadLock(LockSettings):
    """The sync lock classes' hold, per thread (or shared, with ``thread_local=False``)."""

    #: The words of this class's errors and log lines.
    _wording: ClassVar[Wording] = LOCK
    #: The logger of the class's own module, which its log lines keep.
    _logger: ClassVar[logging.Logger]
    _watchdog: Watchdog | None
    local: LockState

    def _fresh_state(self) -> None:
        self.local = ThreadState() if self.thread_local else SharedState()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except LockError:
            if self.raise_on_release_error:
                raise
            self._logger.warning(
                self._wording.subject + " was lost before the with block ended", self.name
            )

    def release(self) -> None:
        """Release the lock if this thread's token still holds it.

        Raises:
            LockError: If this thread does not hold the lock.
            LockNotOwned: If the lock expired or was taken over meanwhile; the
                current holder's key is left untouched.
        """
        local = self.local
        token = local.token
        if token is None:
            raise LockError(self._wording.unheld, lock_name=self.name)
        local.token = None
        lease = local.lease
        if lease is not None:
            # Flag first: a watchdog renewal racing with the delete must not
            # report the lock lost. Drop the callback: the watchdog may hold
            # the lease until its next due time, the callback's closure need not.
            lease.released = True
            lease.on_lost = None
        self.do_release(token)

    def do_release(self, expected_token: bytes) -> None:
        """Give the hold of ``expected_token`` back in one round trip."""
        raise NotImplementedError

    def _renew(self, ms: int, replace: bool, operation: str) -> None:
        """Add (or set, with ``replace``) ``ms`` of TTL to this thread's hold."""
        lease = self.local.lease
        token = self.local.token
        assert lease is not None and token is not None
        sent_at = self._clock()
        left_ms = self._send_renew(token, ms, replace)
        if not left_ms:
            raise self._wording.lost(lease, operation, self.name)
        lease.validate_until(sent_at, left_ms / 1000)

    def _send_renew(self, token: bytes, ms: int, replace: bool) -> int:
        """One renew round trip: the hold's new time left in ms, or 0 if not held."""
        raise NotImplementedError

    @property
    def watchdog(self) -> Watchdog:
        """The watchdog that renews this lock when ``auto_renew`` is set."""
        if self._watchdog is None:
            from .renewal import default_watchdog

            self._watchdog = default_watchdog()
        return self._watchdog
