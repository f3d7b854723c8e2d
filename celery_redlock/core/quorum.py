"""Majority arithmetic of Redlock: votes, the masters of one lock, and node timeouts.

Used by :mod:`celery_redlock.core.redlock`; the asyncio Redlock shares :class:`Votes`,
:func:`lost_vote` and the node timeout rules. A majority is more than half of the
masters; a vote is decided as soon as a majority agreed, or as soon as too few
masters are left to make one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from redis.exceptions import TimeoutError as RedisTimeoutError

from .error_text import describe_error
from .exceptions import ConfigurationError, LockError, QuorumNotAchieved
from .fanout import NOT_ASKED, PENDING, Round
from .lanes import Lane
from .nodes import Node, fork_generation
from .shot import Shot
from .volley import Volley, volley_for
from .votes import GRANTED, Votes
from .wire import Request, Template

__all__ = [
    "GRANTED",
    "NODE_TIMEOUT_MAX",
    "NODE_TIMEOUT_MIN",
    "Masters",
    "Votes",
    "agreed_too_late",
    "check_node_timeout",
    "default_node_timeout",
    "lost_vote",
]

#: Least default node timeout in seconds (the default is a tenth of the TTL).
NODE_TIMEOUT_MIN = 0.05
#: Greatest default node timeout in seconds.
NODE_TIMEOUT_MAX = 1.0


def default_node_timeout(ttl: float | None) -> float:
    """A tenth of the TTL, within 50 ms and 1 s, and never more than half the TTL."""
    if ttl is None:
        return NODE_TIMEOUT_MAX
    return min(max(ttl / 10, NODE_TIMEOUT_MIN), NODE_TIMEOUT_MAX, ttl / 2)


def check_node_timeout(node_timeout: object, ttl: float | None) -> float:
    """Validate a Redlock's ``node_timeout`` in seconds (``None``: the default for ``ttl``).

    Raises:
        ConfigurationError: If it is not a positive number below the TTL.
    """
    if node_timeout is None:
        return default_node_timeout(ttl)
    if isinstance(node_timeout, bool) or not isinstance(node_timeout, (int, float)):
        raise ConfigurationError("node_timeout", node_timeout, "must be a number of seconds")
    if node_timeout <= 0 or (ttl is not None and node_timeout >= ttl):
        raise ConfigurationError(
            "node_timeout", node_timeout, "must be positive and shorter than the timeout"
        )
    return float(node_timeout)


class _ThreadLanes(threading.local):
    # This thread's lane to each master, and the fork generation they belong to.
    lanes: list[Lane | None] | None = None
    generation = -1
    # The same lanes, for rounds that need no more than them (see Volley).
    volley: Volley | None = None


class Masters:
    """The masters of one Redlock, asked all at once."""

    __slots__ = ("_local", "nodes", "quorum", "timeout")

    def __init__(self, nodes: Sequence[Node], timeout: float) -> None:
        self.nodes = tuple(nodes)
        self.timeout = timeout
        self.quorum = len(self.nodes) // 2 + 1
        self._local = _ThreadLanes()

    def lanes(self) -> list[Lane | None]:
        """This thread's lane to each master (``None`` for one that cannot be polled).

        Looked up once per thread, and again in a forked child, whose nodes
        drop the parent's lanes: one check of the fork generation a round.
        """
        local = self._local
        generation = fork_generation()
        lanes = local.lanes
        if lanes is None or local.generation != generation:
            lanes = local.lanes = [node.lane() if node.pollable else None for node in self.nodes]
            local.generation = generation
        return lanes

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
        return Round(self.nodes, requests, claims, self.timeout, self.lanes())

    def open_vote(
        self,
        template: Template,
        value: bytes,
        claims: dict[int, Any] | None = None,
        expected: Any = GRANTED,
    ) -> tuple[Round | Shot, Votes]:
        """Send ``template`` with ``value`` to every master; count until the vote is decided.

        A reply agrees if it equals ``expected`` (with :data:`GRANTED`: if it
        grants an acquire). The round comes back unfinished: the caller calls
        its ``finish()`` (in a ``finally``). On this thread's own connections,
        when all are ready, a :class:`Volley` makes the round; else a
        :class:`Round`.
        """
        local = self._local
        volley = local.volley
        if volley is not None:
            done = volley.run(template, value, claims, expected)
            if done is not None:
                return done
        if volley is None or not volley.current:
            volley = local.volley = volley_for(self.nodes, self.lanes(), self.timeout)
            if volley is not None:
                done = volley.run(template, value, claims, expected)
                if done is not None:
                    return done
        votes = Votes(len(self.nodes))
        round_ = self.send(template.request(value), claims)
        try:
            round_.collect(votes.settle(None, expected))
        except BaseException:
            round_.finish()
            raise
        return round_, votes

    def vote(
        self,
        request: Request,
        agrees: Callable[[int, Any], bool] | None,
        claims: dict[int, Any] | None = None,
        expected: Any = None,
    ) -> tuple[Round, Votes]:
        """Send ``request`` to every master and count until a majority is won or lost.

        A reply agrees as :meth:`Votes.settle` has it: ``agrees`` says so, or
        without it, the reply equals ``expected``.
        """
        votes = Votes(len(self.nodes))
        round_ = self.send(request, claims)
        try:
            round_.collect(votes.settle(agrees, expected))
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
        round_: Round | Shot,
        votes: Votes,
        refusal: Callable[[Any], LockError | None],
    ) -> QuorumNotAchieved:
        """Describe a lost vote: what each master that did not agree answered."""
        return lost_vote(
            message,
            lock_name,
            [node.name for node in self.nodes],
            round_.outcomes,
            votes,
            refusal,
            self.timeout,
            round_.expired,
        )


def lost_vote(
    message: str,
    lock_name: str,
    names: Sequence[str],
    outcomes: Sequence[Any],
    votes: Votes,
    refusal: Callable[[Any], LockError | None],
    node_timeout: float,
    expired: bool,
) -> QuorumNotAchieved:
    """Describe a lost vote: what each master that did not agree answered.

    Args:
        message: What failed, e.g. ``"Lock x not acquired"``.
        lock_name: The lock's key.
        names: The masters' names, in the order of ``outcomes``.
        outcomes: Each master's reply, error, ``PENDING`` or ``NOT_ASKED``.
        votes: The count.
        refusal: Turns a reply into the reason it did not agree, or ``None``.
        node_timeout: The node timeout in seconds, named for masters still pending.
        expired: Whether the wait ended at the node timeout rather than at a
            lost vote, which is what a pending master's error then says.
    """
    errors: dict[str, BaseException] = {}
    for name, outcome in zip(names, outcomes):
        if outcome is NOT_ASKED:
            continue
        if outcome is PENDING:
            errors[name] = RedisTimeoutError(
                f"no answer within the node timeout ({node_timeout * 1000:.0f} ms)"
                if expired
                else "not awaited: the vote was lost before it answered"
            )
        elif isinstance(outcome, BaseException):
            errors[name] = outcome
        else:
            refused = refusal(outcome)
            if refused is not None:
                errors[name] = refused
    details = "; ".join(f"{name}: {describe_error(error)}" for name, error in errors.items())
    return QuorumNotAchieved(
        f"{message}: {votes.granted} of {len(names)} masters agreed, "
        f"{votes.needed} needed" + (f" ({details})" if details else ""),
        lock_name=lock_name,
        errors=errors,
        granted=votes.granted,
        needed=votes.needed,
    )


def agreed_too_late(
    lock_name: str, elapsed: float, ttl: float | None, votes: Votes
) -> QuorumNotAchieved:
    """The error of an acquire whose majority agreed after ``elapsed`` seconds, too late.

    A majority said yes, but so late that no validity of the ``ttl`` is left
    once the drift allowance is taken off.
    """
    return QuorumNotAchieved(
        f"Lock {lock_name} not acquired: the majority agreed after "
        f"{elapsed * 1000:.1f} ms, leaving no validity of the {ttl} s TTL",
        lock_name=lock_name,
        granted=votes.granted,
        needed=votes.needed,
    )
