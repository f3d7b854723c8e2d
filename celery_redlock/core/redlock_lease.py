"""A lease held on a majority of Redlock's masters, renewed by a quorum vote of its own.

Handed out by :class:`~celery_redlock.core.redlock.Redlock`. The watchdog
calls :meth:`RedlockLease.renew` for it instead of batching it per connection
pool, since it spans several servers.
"""

from __future__ import annotations

from typing import Any

from .exceptions import LockError, LockNotOwned, QuorumNotAchieved
from .lease import Lease
from .quorum import Masters
from .scripts import RENEW
from .wire import Request

__all__ = ["RedlockLease"]


class RedlockLease(Lease):
    """A :class:`Lease` held on a majority of masters; renews itself with a quorum vote.

    The watchdog calls :meth:`renew` for it instead of batching it per
    connection pool.
    """

    renews_itself = True

    __slots__ = ("masters", "stragglers")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The lease's "client" is the set of masters it spans.
        self.masters: Masters = self.client
        # Connections carrying this lease's acquire to masters that had not
        # answered when the majority was reached; the release goes behind it.
        self.stragglers: dict[int, Any] = {}

    def renew(self) -> None:
        """Set the TTL back to its full length on a majority of masters (the watchdog's hook).

        Raises:
            LockNotOwned: As :meth:`renew_for` does.
            QuorumNotAchieved: As :meth:`renew_for` does.
        """
        assert self.ttl is not None
        self.renew_for(int(self.ttl * 1000), True, "renew")

    def renew_for(self, ms: int, replace: bool, operation: str) -> None:
        """Set (``replace``) or add ``ms`` milliseconds of TTL on a majority of masters.

        The new validity runs from when the request was sent, for the shortest
        TTL among the majority that agreed, minus the drift allowance.

        Raises:
            LockNotOwned: If a majority no longer holds this lease's token; the
                lease is marked lost first.
            QuorumNotAchieved: If too few masters answered, or the majority's
                answer came too late to leave any validity.
        """
        sent_at = self._clock()
        pttls: list[int] = []

        def agrees(i: int, reply: Any) -> bool:
            if reply and int(reply[0]) > 0:
                pttls.append(int(reply[0]))
                return True
            return False

        request = Request.run(RENEW, (self.name,), ("1" if replace else "0", self.token, ms))
        round_, votes = self.masters.vote(request, agrees)
        if votes.won:
            deadline = self.deadline_for(sent_at, min(pttls) / 1000)
            if deadline > self._clock():
                self.deadline = deadline
                return
            raise QuorumNotAchieved(
                f"Cannot {operation} lock {self.name}: the majority agreed too late to "
                "leave any validity",
                lock_name=self.name,
                granted=votes.granted,
                needed=votes.needed,
            )
        if votes.refused_by_majority:
            self.mark_lost(f"not owned at {operation} on a majority of masters")
            # Masters that still hold our token would keep others out until it expires.
            self.masters.fire(Request.release(self.name, self.token))
            raise LockNotOwned(
                f"Cannot {operation} a lock that's no longer owned", lock_name=self.name
            )
        raise self.masters.failure(
            f"Cannot {operation} lock {self.name}", self.name, round_, votes, self._refusal
        )

    def _refusal(self, reply: Any) -> LockError | None:
        if reply and int(reply[0]) > 0:
            return None
        return LockNotOwned("this lease's token is not there", lock_name=self.name)
