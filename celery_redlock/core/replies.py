"""What the masters' replies to a Redlock acquire say, for both Redlock versions.

The acquire script answers a grant with the fence, and a refusal with
``{PTTL, holder's value}``; a plain ``SET NX`` refuses with ``None``. These
functions turn such replies into the holder a failed attempt reports and the
reason a master gives in :attr:`QuorumNotAchieved.errors`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Union

from .exceptions import LockError, LockNotAcquired

__all__ = ["Holder", "as_bytes", "holder_of", "most_common_holder", "refusal_of_acquire", "text"]

#: A holder seen on a master: its value and the seconds it has left there.
Holder = tuple[Union[str, None], Union[float, None]]


def text(value: Any) -> str | None:
    """A reply as text (bytes decoded as UTF-8); ``None`` stays ``None``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None if value is None else str(value)


def as_bytes(value: Any) -> bytes | None:
    """A reply as bytes, to compare with a token whatever the client decodes."""
    return value.encode() if isinstance(value, str) else value


def holder_of(reply: Sequence[Any]) -> Holder:
    """The holder named by the acquire script's ``{PTTL, value}`` refusal."""
    return text(reply[1]), reply[0] / 1000 if reply[0] >= 0 else None


def most_common_holder(holders: Sequence[Holder]) -> Holder:
    """The value held on most masters, with the longest time it has left on them."""
    value = Counter(holder for holder, _ in holders).most_common(1)[0][0]
    ttls = [ttl for holder, ttl in holders if holder == value and ttl is not None]
    return value, max(ttls) if ttls else None


def refusal_of_acquire(lock_name: str, reply: Any) -> LockError | None:
    """Why a master refused an acquire: who holds the lock there (``None``: it agreed)."""
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
