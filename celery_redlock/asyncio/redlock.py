"""Redlock for asyncio: one lock over N independent ``redis.asyncio`` masters.

The asyncio counterpart of :class:`celery_redlock.Redlock`, built on
:class:`celery_redlock.asyncio.Lock` (per-task state, renewal task,
cancellation safety) with every round trip sent to all masters at once
(``asyncio.gather``, each master bounded by the node timeout) and decided by a
majority:

- acquire: the fencing acquire script on every master; held when a majority
  granted it with validity left, ``ttl - elapsed - (ttl * drift + 2 ms)``
  counted from before sending. The fence handed out is the largest any master
  drew, raised on the masters that drew less until a majority holds it (the
  ``RAISE_FENCE`` script). A failed attempt is released on every master that
  granted it or did not answer.
- release / extend / reacquire / renewal: compare-and-delete or
  compare-and-``PEXPIRE`` on every master; a majority must agree.

Unlike the thread version it waits for every master (up to the node timeout)
rather than returning as soon as the vote is decided.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from celery_redlock.exceptions import (
    ConfigurationError,
    LockError,
    LockNotAcquired,
    QuorumNotAchieved,
)
from celery_redlock.lock import Lease, Number
from celery_redlock.quorum import default_node_timeout
from celery_redlock.scripts import ACQUIRE, RAISE_FENCE, RELEASE, RENEW, Arg, Script

from .lock import Lock
from .renewal import Renewer
from .scripts import run_script

__all__ = ["Redlock"]


def _node_name(client: Any) -> str:
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if "path" in kwargs:
        return f"unix://{kwargs['path']}/{kwargs.get('db', 0)}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"


def _text(value: Any) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class _Masters:
    """The masters of one Redlock: fan-out of one request, and the majority rule."""

    def __init__(self, clients: Sequence[Any], name: str, timeout: float) -> None:
        self.clients = tuple(clients)
        self.names = tuple(_node_name(client) for client in clients)
        self.name = name
        self.timeout = timeout
        self.quorum = len(clients) // 2 + 1

    async def _one(self, i: int, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        try:
            return await asyncio.wait_for(
                run_script(script, self.clients[i], keys, args), self.timeout
            )
        except asyncio.TimeoutError:
            return TimeoutError(f"no answer within {self.timeout} s")
        except Exception as exc:  # one master's failure is a vote, not an error
            return exc

    async def ask(
        self,
        script: Script,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        only: Sequence[int] | None = None,
    ) -> dict[int, Any]:
        """Send the script to every master (or those in ``only``); reply or exception by index."""
        targets = range(len(self.clients)) if only is None else only
        replies = await asyncio.gather(*(self._one(i, script, keys, args) for i in targets))
        return dict(zip(targets, replies))

    def failure(
        self, message: str, replies: dict[int, Any], agreed: int, refusal: Any
    ) -> QuorumNotAchieved:
        """The error of a vote that did not reach a majority, with each master's reason."""
        errors: dict[str, BaseException] = {}
        for i, reply in replies.items():
            if isinstance(reply, BaseException):
                errors[self.names[i]] = reply
            else:
                reason = refusal(reply)
                if reason is not None:
                    errors[self.names[i]] = reason
        return QuorumNotAchieved(
            f"{message}: {agreed} of {len(self.clients)} masters agreed, {self.quorum} needed",
            lock_name=self.name,
            errors=errors,
            granted=agreed,
            needed=self.quorum,
        )

    async def renew(self, lease: Lease, ms: int, replace: bool = True) -> int:
        """Renew ``lease`` on a majority: the shortest new TTL among them, 0 if not ours.

        Raises:
            QuorumNotAchieved: If too few masters answered to tell.
        """
        replies = await self.ask(RENEW, (lease.name,), ("1" if replace else "0", lease.token, ms))
        pttls = [
            int(reply[0])
            for reply in replies.values()
            if isinstance(reply, list) and int(reply[0]) > 0
        ]
        if len(pttls) >= self.quorum:
            return min(pttls)
        refused = sum(1 for reply in replies.values() if isinstance(reply, list) and not reply[0])
        if refused >= self.quorum:
            # Masters that still hold our token would keep others out until it expires.
            await self.ask(RELEASE, (lease.name,), (lease.token,))
            return 0
        raise self.failure(
            f"Cannot renew lock {lease.name}",
            replies,
            len(pttls),
            lambda reply: None if reply and int(reply[0]) > 0 else LockError("not ours"),
        )


class Redlock(Lock):
    """A lock held on a majority of independent ``redis.asyncio`` masters.

    After ``masters`` it takes :class:`celery_redlock.asyncio.Lock`'s arguments;
    ``sleep`` is the mean pause between attempts (each drawn between half and
    one and a half of it, so contenders stop splitting the vote).

    Args:
        masters: ``redis.asyncio.Redis`` clients, one per independent master.
        name: The Redis key of the lock, the same on every master.
        *args: :class:`celery_redlock.asyncio.Lock`'s positional arguments after ``name``.
        node_timeout: Longest wait for one master, in seconds; by default a tenth
            of the TTL within 50 ms and 1 s. Must be shorter than the TTL.
        **options: :class:`celery_redlock.asyncio.Lock`'s keyword-only arguments.

    Raises:
        ConfigurationError: If an argument is out of range, naming it.
    """

    def __init__(
        self,
        masters: Sequence[Any],
        name: str,
        *args: Any,
        node_timeout: Number | None = None,
        **options: Any,
    ) -> None:
        if isinstance(masters, (str, bytes)) or not masters:
            raise ConfigurationError("masters", masters, "must be a non-empty list of clients")
        super().__init__(masters[0], name, *args, **options)
        if node_timeout is None:
            node_timeout = default_node_timeout(self.timeout)
        elif (
            isinstance(node_timeout, bool)
            or not isinstance(node_timeout, (int, float))
            or node_timeout <= 0
            or (self.timeout is not None and node_timeout >= self.timeout)
        ):
            raise ConfigurationError(
                "node_timeout", node_timeout, "must be positive and shorter than the timeout"
            )
        self.node_timeout = float(node_timeout)
        self._masters = _Masters(masters, name, self.node_timeout)
        twice = [n for n, count in Counter(self._masters.names).items() if count > 1]
        if twice:
            raise ConfigurationError("masters", twice, "name the same server more than once")
        self.masters = tuple(masters)

    @property
    def quorum(self) -> int:
        """How many masters must agree: more than half of them."""
        return self._masters.quorum

    def _retry_delay(self, sleep: Number) -> float:
        return float(sleep) * random.uniform(0.5, 1.5)

    def _encode_token(self, token: str | bytes) -> bytes:
        # Masters may differ in encoding options: send UTF-8, redis-py's default.
        return token.encode() if isinstance(token, str) else bytes(token)

    def _renewer(self) -> Renewer:
        return self._masters.renew

    async def _send_acquire(self, token: bytes) -> tuple[bool, Any]:
        masters = self._masters
        sent_at = self._clock()
        if self.fencing:
            keys: tuple[Arg, ...] = (self.name, self.fence_key)
            replies = await masters.ask(
                ACQUIRE, keys, (token, self._ttl_ms, self._fence_retention_ms)
            )
        else:
            replies = await masters.ask(_SET_NX, (self.name,), (token, self._ttl_ms))
        fences = {
            i: int(reply)
            for i, reply in replies.items()
            if not isinstance(reply, (BaseException, list)) and reply
        }
        holders = [reply for reply in replies.values() if isinstance(reply, list)]
        fence: int | None = None
        failure: QuorumNotAchieved | None = None
        if len(fences) < masters.quorum:
            failure = masters.failure(
                f"Lock {self.name} not acquired", replies, len(fences), self._refusal
            )
        elif self.fencing:
            fence, failure = await self._hand_out_fence(token, fences)
        if failure is None:
            validity = self.timeout
            if validity is not None:
                left = sent_at + validity - (validity * self.drift_factor + 0.002)
                if left <= self._clock():
                    failure = QuorumNotAchieved(
                        f"Lock {self.name} not acquired: the majority agreed too late "
                        "to leave any validity",
                        lock_name=self.name,
                        granted=len(fences),
                        needed=masters.quorum,
                    )
        if failure is not None:
            # Masters that granted it, or may have before failing, must give it back.
            undo = [
                i for i, reply in replies.items() if i in fences or isinstance(reply, BaseException)
            ]
            if undo:
                await masters.ask(RELEASE, (self.name,), (token,), only=undo)
            holder = self._holder_summary(holders)
            failure.holder, failure.holder_ttl = holder
            return False, holder
        return True, fence

    @staticmethod
    def _holder_summary(holders: list[Any]) -> tuple[str | None, float | None]:
        if not holders:
            return None, None
        value = Counter(_text(reply[1]) for reply in holders).most_common(1)[0][0]
        ttls = [reply[0] / 1000 for reply in holders if _text(reply[1]) == value and reply[0] >= 0]
        return value, max(ttls) if ttls else None

    def _refusal(self, reply: Any) -> LockError | None:
        if isinstance(reply, list):
            return LockNotAcquired(
                f"held by {_text(reply[1])!r}", lock_name=self.name, holder=_text(reply[1])
            )
        return LockNotAcquired("held by another token", lock_name=self.name)

    async def _hand_out_fence(
        self, token: bytes, fences: dict[int, int]
    ) -> tuple[int | None, QuorumNotAchieved | None]:
        """Hand out the largest fence drawn, once a majority of counters holds it."""
        fence = max(fences.values())
        holding = [i for i, drawn in fences.items() if drawn == fence]
        if len(holding) >= self._masters.quorum:
            return fence, None
        others = [i for i in range(len(self._masters.clients)) if i not in holding]
        replies = await self._masters.ask(
            RAISE_FENCE,
            (self.name, self.fence_key),
            (token, fence, self._fence_retention_ms),
            only=others,
        )
        raised = len(holding) + sum(1 for reply in replies.values() if reply == 1)
        if raised >= self._masters.quorum:
            return fence, None
        return None, self._masters.failure(
            f"Lock {self.name} not acquired: fence {fence} not recorded",
            replies,
            raised,
            lambda reply: None if reply == 1 else LockError("counter not raised", self.name),
        )

    async def _send_release(self, token: bytes) -> bool:
        replies = await self._masters.ask(RELEASE, (self.name,), (token,))
        released = sum(1 for reply in replies.values() if reply == 1)
        if released >= self.quorum:
            return True
        refused = sum(1 for reply in replies.values() if reply == 0)
        if refused >= self.quorum:
            return False
        raise self._masters.failure(
            f"Cannot release lock {self.name}",
            replies,
            released,
            lambda reply: None if reply == 1 else LockError("the token is not there", self.name),
        )

    async def _send_renew(self, lease: Lease, ms: int, replace: bool) -> int:
        return await self._masters.renew(lease, ms, replace)

    async def locked(self) -> bool:
        """Return ``True`` if one value is stored under the name on a majority of masters."""
        values = await asyncio.gather(
            *(self._get(client) for client in self._masters.clients), return_exceptions=True
        )
        counts = Counter(v for v in values if v is not None and not isinstance(v, BaseException))
        return max(counts.values(), default=0) >= self.quorum

    async def _owned(self, state: Any) -> bool:
        token = (state or self._state()).token
        if token is None:
            return False
        values = await asyncio.gather(
            *(self._get(client) for client in self._masters.clients), return_exceptions=True
        )
        return sum(1 for value in values if value == token) >= self.quorum

    async def _get(self, client: Any) -> bytes | None:
        value = await asyncio.wait_for(client.get(self.name), self.node_timeout)
        return value.encode() if isinstance(value, str) else value

    def __repr__(self) -> str:
        return (
            f"<asyncio Redlock {self.name!r} timeout={self.timeout} "
            f"masters={len(self._masters.clients)} quorum={self.quorum}>"
        )


# SET NX for Redlock without fencing, as a script so that every master's vote
# comes back through one path.
#
# KEYS[1]  lock key
# ARGV[1]  token
# ARGV[2]  ttl in milliseconds; "0" means the lock never expires
# Returns  1 when the lock was taken, otherwise {PTTL, holder's value}.
_SET_NX = Script(
    "set_nx",
    """
local taken
if tonumber(ARGV[2]) > 0 then
  taken = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
else
  taken = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if taken then
  return 1
end
return {redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[1])}
""",
)
