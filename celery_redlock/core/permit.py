"""One permit of a semaphore: its lease, and the limit of permits a semaphore may have.

:class:`PermitLease` is what :class:`~celery_redlock.Semaphore` (and its
asyncio twin) hand out and what ``current_lock()`` returns under a limit; the
watchdog renews it like a lock's lease, batched with them, through
:data:`~celery_redlock.core.semaphore_scripts.RENEW_PERMITS`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .exceptions import ConfigurationError
from .lease import DEFAULT_DRIFT_FACTOR, Clock, Lease, LostCallback
from .lua import Script
from .semaphore_scripts import RENEW_PERMITS

__all__ = ["MAX_LIMIT", "WAIT_SLACK", "PermitLease", "check_limit"]

#: Most permits a semaphore may have: every acquire reads the permits held.
MAX_LIMIT = 10_000
#: Seconds a waiter's place on the wait list outlives its latest attempt,
#: beyond twice the time between attempts: a waiter that died frees its place then.
WAIT_SLACK = 2.0


def check_limit(setting: str, value: object) -> int:
    """Return ``value`` as a permit count (a whole number from 1 to :data:`MAX_LIMIT`).

    Raises:
        ConfigurationError: If it is not such a number, naming ``setting``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise ConfigurationError(setting, value, f"must be a whole number from 1 to {MAX_LIMIT}")
    return value


class PermitLease(Lease):
    """One permit of a :class:`~celery_redlock.Semaphore`: a :class:`Lease` with its slot.

    ``name`` is the semaphore's name and ``token`` the permit's member in the
    permits set (``<slot>|<fence>|<holder's token>``).

    Attributes:
        slot: Which of the semaphore's permits this is, from 0 to limit - 1; at
            most one holder occupies a slot at a time. To fence writes, key the
            downstream resource by name and slot and reject a fence below the
            highest that slot has seen: one highest fence per name would turn
            away the other holders' writes.
    """

    renew_script: ClassVar[Script] = RENEW_PERMITS

    __slots__ = ("_permits_key", "slot")

    def __init__(
        self,
        *,
        slot: int,
        permits_key: str,
        client: Any,
        name: str,
        token: bytes,
        fence: int | None,
        ttl: float | None,
        sent_at: float,
        clock: Clock,
        drift_factor: float = DEFAULT_DRIFT_FACTOR,
        on_lost: LostCallback | None = None,
        owner: object | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__(
            client=client,
            name=name,
            token=token,
            fence=fence,
            ttl=ttl,
            sent_at=sent_at,
            clock=clock,
            drift_factor=drift_factor,
            on_lost=on_lost,
            owner=owner,
            label=label,
        )
        self.slot = slot
        self._permits_key = permits_key

    @property
    def renew_key(self) -> str:
        """The permits set: where :data:`RENEW_PERMITS` finds this permit."""
        return self._permits_key

    def describe(self) -> str:
        """Name the semaphore, the slot, the holder and the fence, for log lines."""
        holder = f" held by {self.label}" if self.label else ""
        return f"permit {self.slot} of semaphore {self.name}{holder} (fence {self.fence})"

    def __repr__(self) -> str:
        state = "lost" if self.known_lost else "released" if self.released else "held"
        return f"<PermitLease {self.name!r} slot={self.slot} fence={self.fence} {state}>"
