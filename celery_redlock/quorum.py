"""Majority arithmetic of Redlock: votes, the masters of one lock, and node timeouts.

Internal to :mod:`celery_redlock.redlock`. A majority is more than half of the
masters; a vote is decided as soon as a majority agreed, or as soon as too few
masters are left to make one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from redis.exceptions import TimeoutError as RedisTimeoutError

from .exceptions import LockError, QuorumNotAchieved
from .fanout import NOT_ASKED, PENDING, Round, Settle
from .nodes import Node, Request

__all__ = ["NODE_TIMEOUT_MAX", "NODE_TIMEOUT_MIN", "Masters", "Votes", "default_node_timeout"]

#: Least default node timeout in seconds (the default is a tenth of the TTL).
NODE_TIMEOUT_MIN = 0.05
#: Greatest default node timeout in seconds.
NODE_TIMEOUT_MAX = 1.0


def default_node_timeout(ttl: float | None) -> float:
    """A tenth of the TTL, within 50 ms and 1 s, and never more than half the TTL."""
    if ttl is None:
        return NODE_TIMEOUT_MAX
    return min(max(ttl / 10, NODE_TIMEOUT_MIN), NODE_TIMEOUT_MAX, ttl / 2)


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

    def settle(self, agrees: Callable[[int, Any], bool]) -> Settle:
        """A ``settle`` callback for :meth:`Round.collect` that counts votes."""
        # Decided once a majority agreed, or once too few are left to make one.
        needed = self.needed
        spare = self.size - needed

        def count(i: int, outcome: Any) -> bool:
            if isinstance(outcome, BaseException):
                self.failed += 1
            elif agrees(i, outcome):
                self.granted += 1
                return self.granted >= needed
            else:
                self.refused += 1
            return self.granted >= needed or self.refused + self.failed > spare

        return count


class Masters:
    """The masters of one Redlock, asked all at once."""

    __slots__ = ("nodes", "quorum", "timeout")

    def __init__(self, nodes: Sequence[Node], timeout: float) -> None:
        self.nodes = tuple(nodes)
        self.timeout = timeout
        self.quorum = len(self.nodes) // 2 + 1

    @contextlib.contextmanager
    def ask(
        self, request: Request | Sequence[Request | None], claims: dict[int, Any] | None = None
    ) -> Iterator[Round]:
        """Send ``request`` (or one request per master) to every master at once.

        Leaving the block parks the connections whose replies were not awaited,
        so that they are read before the connection is reused.
        """
        round_ = self.send(request, claims)
        try:
            yield round_
        finally:
            round_.finish()

    def send(
        self, request: Request | Sequence[Request | None], claims: dict[int, Any] | None = None
    ) -> Round:
        """Send ``request`` (or one request per master) to every master at once.

        What :meth:`ask` does, for callers that call :meth:`Round.finish`
        themselves (in a ``finally``).
        """
        requests = [request] * len(self.nodes) if isinstance(request, Request) else request
        return Round(self.nodes, requests, claims, self.timeout)

    def vote(
        self,
        request: Request,
        agrees: Callable[[int, Any], bool],
        claims: dict[int, Any] | None = None,
    ) -> tuple[Round, Votes]:
        """Send ``request`` to every master and count until a majority is won or lost."""
        votes = Votes(len(self.nodes))
        round_ = self.send(request, claims)
        try:
            round_.collect(votes.settle(agrees))
        finally:
            round_.finish()
        return round_, votes

    def fire(self, request: Request) -> None:
        """Send ``request`` to every master without waiting for the answers."""
        self.send(request).finish()

    def failure(
        self,
        message: str,
        lock_name: str,
        round_: Round,
        votes: Votes,
        refusal: Callable[[Any], LockError | None],
    ) -> QuorumNotAchieved:
        """Describe a lost vote: what each master that did not agree answered."""
        errors: dict[str, BaseException] = {}
        for node, outcome in zip(self.nodes, round_.outcomes):
            if outcome is NOT_ASKED:
                continue
            if outcome is PENDING:
                errors[node.name] = RedisTimeoutError(
                    f"no answer within the node timeout ({self.timeout * 1000:.0f} ms)"
                    if round_.expired
                    else "not awaited: the vote was lost before it answered"
                )
            elif isinstance(outcome, BaseException):
                errors[node.name] = outcome
            else:
                refused = refusal(outcome)
                if refused is not None:
                    errors[node.name] = refused
        details = "; ".join(f"{name}: {error}" for name, error in errors.items())
        return QuorumNotAchieved(
            f"{message}: {votes.granted} of {len(self.nodes)} masters agreed, "
            f"{votes.needed} needed" + (f" ({details})" if details else ""),
            lock_name=lock_name,
            errors=errors,
            granted=votes.granted,
            needed=votes.needed,
        )
