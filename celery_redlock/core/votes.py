"""A majority vote among a Redlock's masters, counted reply by reply.

Shared by :mod:`celery_redlock.core.quorum`, :mod:`celery_redlock.core.volley`
and the asyncio Redlock (re-exported by ``quorum``). A majority is more than
half of the masters; a vote is decided as soon as a majority agreed, or as
soon as too few masters are left to make one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .fanout import Settle

__all__ = ["GRANTED", "Votes", "granted"]

#: ``expected`` of a vote on an acquire: any reply agrees but the refusals,
#: ``None`` (``SET NX``) and a list (the acquire script's holder).
GRANTED: Any = object()


def granted(i: int, reply: Any) -> bool:
    """Whether an acquire's ``reply`` grants the lock (see :data:`GRANTED`)."""
    return reply is not None and type(reply) is not list


class Votes:
    """A majority vote among ``size`` masters."""

    __slots__ = ("failed", "granted", "needed", "refused", "size")

    def __init__(self, size: int, granted: int = 0) -> None:
        self.size = size
        self.needed = size // 2 + 1
        self.granted = granted
        self.refused = 0
        self.failed = 0

    @property
    def won(self) -> bool:
        """A majority agreed."""
        return self.granted >= self.needed

    @property
    def refused_by_majority(self) -> bool:
        """Enough masters answered no that no majority can say yes, whatever the rest do."""
        return self.refused > self.size - self.needed

    def settle(
        self, agrees: Callable[[int, Any], bool] | None = None, expected: Any = None
    ) -> Settle:
        """A ``settle`` callback for :meth:`Round.collect` that counts votes.

        A reply agrees if ``agrees(index, reply)`` says so or, without
        ``agrees``, if it equals ``expected``: a release (``1``) is voted on at
        every cycle of a lock, and this saves it a call per reply. With
        :data:`GRANTED`, an acquire's grant agrees.
        """
        if agrees is None and expected is GRANTED:
            agrees = granted
        # Decided once a majority agreed, or once too few are left to make one.
        needed = self.needed
        spare = self.size - needed

        def count(i: int, outcome: Any) -> bool:
            if isinstance(outcome, BaseException):
                self.failed += 1
            elif agrees(i, outcome) if agrees is not None else outcome == expected:
                self.granted += 1
                return self.granted >= needed
            else:
                self.refused += 1
            return self.granted >= needed or self.refused + self.failed > spare

        return count
