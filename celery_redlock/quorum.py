"""The majority rule of Redlock, shared by the thread and the asyncio versions.

Both versions send one request to every master at once and stop waiting as
soon as the vote is decided: won once a majority agreed, lost once so many
refused or failed that no majority is left. This module holds what does not
depend on how the requests travel: counting the votes (:class:`Votes`), naming
a master, reading the acquire script's "held by" answers, and describing a lost
vote as a :class:`~celery_redlock.exceptions.QuorumNotAchieved` that carries
each master's reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from redis.exceptions import TimeoutError as RedisTimeoutError

from .exceptions import LockError, LockNotAcquired, QuorumNotAchieved

__all__ = [
    "NOT_ASKED",
    "PENDING",
    "Holder",
    "Votes",
    "as_bytes",
    "holder_of",
    "lost_vote",
    "most_common_holder",
    "node_address",
    "refusal_of_acquire",
    "text",
]

#: A holder seen on a master: its value and the seconds it has left there.
Holder = tuple[Union[str, None], Union[float, None]]
#: A refusal: what a master's reply says against the vote, ``None`` if it agreed.
Refusal = Callable[[Any], Union[LockError, None]]

#: The outcome of a master that was sent the request but has not answered.
PENDING = object()
#: The outcome of a master the request was not sent to.
NOT_ASKED = object()


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

    def settle(self, agrees: Callable[[int, Any], bool]) -> Callable[[int, Any], bool]:
        """A callback that counts master ``i``'s reply or error; ``True`` once decided."""

        def count(i: int, outcome: Any) -> bool:
            if isinstance(outcome, BaseException):
                self.failed += 1
            elif agrees(i, outcome):
                self.granted += 1
            else:
                self.refused += 1
            # Decided once a majority agreed, or once too few are left to make one.
            return self.won or self.refused + self.failed > self.size - self.needed

        return count


def node_address(kwargs: Mapping[str, Any]) -> str:
    """A master's name in errors: ``host:port/db``, or ``unix://path?db=N``."""
    db = kwargs.get("db", 0)
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={db}"
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"


def text(value: Any) -> str | None:
    """A reply as text (bytes decoded as UTF-8), ``None`` kept."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None if value is None else str(value)


def as_bytes(value: Any) -> bytes | None:
    """A reply as bytes, for comparing with a token whatever the client decodes."""
    return value.encode() if isinstance(value, str) else value


def holder_of(reply: Sequence[Any]) -> Holder:
    """The holder named by the acquire script's ``{PTTL, value}`` answer."""
    return text(reply[1]), reply[0] / 1000 if reply[0] >= 0 else None


def most_common_holder(holders: Sequence[Holder]) -> Holder:
    """The value held on most masters, with the longest time it has left on them."""
    value = Counter(holder for holder, _ in holders).most_common(1)[0][0]
    ttls = [ttl for holder, ttl in holders if holder == value and ttl is not None]
    return value, max(ttls) if ttls else None


def refusal_of_acquire(lock_name: str, reply: Any) -> LockError | None:
    """Why a master refused an acquire: who holds the lock there (``None`` if it agreed)."""
    if isinstance(reply, list):
        holder, ttl = holder_of(reply)
        return LockNotAcquired(
            f"held by {holder!r}" + (f" for {ttl:g} s more" if ttl is not None else ""),
            lock_name=lock_name,
            holder=holder,
            holder_ttl=ttl,
        )
    if reply is None:  # a plain SET NX refused
        return LockNotAcquired("held by another token", lock_name=lock_name)
    return None


def lost_vote(
    message: str,
    lock_name: str,
    names: Sequence[str],
    outcomes: Sequence[Any],
    votes: Votes,
    refusal: Refusal,
    node_timeout: float,
    expired: bool,
) -> QuorumNotAchieved:
    """Describe a lost vote: what each master that did not agree answered.

    Args:
        message: What failed, e.g. ``"Lock x not acquired"``.
        lock_name: The lock's key.
        names: The masters' names, in the order of ``outcomes``.
        outcomes: Each master's reply, error, :data:`PENDING` or :data:`NOT_ASKED`.
        votes: The count.
        refusal: Turns a reply into the reason it did not agree, or ``None``.
        node_timeout: The node timeout in seconds, for masters still pending.
        expired: Whether the wait ended at the node timeout (rather than at a
            lost vote), which is what a pending master's error then says.
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
    details = "; ".join(f"{name}: {error}" for name, error in errors.items())
    return QuorumNotAchieved(
        f"{message}: {votes.granted} of {len(names)} masters agreed, "
        f"{votes.needed} needed" + (f" ({details})" if details else ""),
        lock_name=lock_name,
        errors=errors,
        granted=votes.granted,
        needed=votes.needed,
    )
