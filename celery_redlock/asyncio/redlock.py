"""Redlock for asyncio: one lock over N independent ``redis.asyncio`` masters.

The asyncio counterpart of :class:`celery_redlock.Redlock`, built on
:class:`celery_redlock.asyncio.Lock` (per-task state, renewal task,
cancellation safety). Each operation sends its request to every master at once,
each in a task of its own, and is decided by a majority with the same rule as
the thread version (:mod:`celery_redlock.core.quorum`): it returns as soon as a
majority agreed, fails as soon as so many masters refused or failed that no
majority is left, and otherwise waits at most the node timeout.

- acquire: the fencing acquire script on every master; held when a majority
  granted it with validity left, ``ttl - elapsed - (ttl * drift + 2 ms)``
  counted from before sending. The fence handed out is the largest any master
  drew, raised on the masters that drew less until a majority holds it (the
  ``RAISE_FENCE`` script). A failed attempt raises (in ``async with``)
  :class:`~celery_redlock.core.exceptions.QuorumNotAchieved` with each master's reason.
- release / extend / reacquire / renewal: compare-and-delete or
  compare-and-``PEXPIRE`` on every master; a majority must agree.

Requests are never cancelled when the vote no longer waits for them: a command
already written to a hung master runs when the master resumes, cancelled or
not, so its reply is awaited instead, in the background. Requests for one lock
key through one client object are sent in order: each waits until the one
before it has answered (or failed). So the release of an acquisition, whether
after a failed attempt or when the lock is released while a master has still
not answered the acquire, reaches that master after the acquire, and a late
grant is deleted as soon as it is made; and an acquire right after a release
never meets the released key on a master the release did not wait for. A
request's reply is awaited for ``KEEP_FOR`` (5) node timeouts even when the
client's ``socket_timeout`` is shorter, so that a slow master's connection is
not given up while the next request waits behind it. Two cases escape this:
a master silent for longer than that with a client ``socket_timeout`` (the
release then goes on another connection, which the master may run before
the acquire), and the event loop closing while the acquire is unanswered (no
release is sent; await :func:`~.shielding.drain` before closing it). A grant
made after either expires with the lock's TTL, counted from when the master
ran it. An acquire never written (its connection could not be opened:
``NotSent``) is owed no release, and gets none.

That queue is bounded (:class:`~.ordering.KeyQueue`): while a master has left
a request for the key unanswered for the node timeout, or has ``MAX_PENDING``
of them pending, further requests for the key fail there at once, counted as
that master's failure, except the release each queued acquire is owed. A master
hung for good (cut off without a connection reset, and clients without a
``socket_timeout``) thus costs a few pending requests per key, and stays
failed for that key in this process until its connection fails.

Each attempt of an acquire stores a value of its own (``token``, then
``token|N``; see :meth:`Redlock._attempt_value`), so a failed attempt's release
that a master runs after the next attempt (the ``socket_timeout`` case above)
cannot delete that attempt's grant.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from celery_redlock.core.exceptions import (
    ConfigurationError,
    LockError,
    LockNotOwned,
    QuorumNotAchieved,
)
from celery_redlock.core.fanout import PENDING
from celery_redlock.core.lease import Lease
from celery_redlock.core.lock_options import Number
from celery_redlock.core.lua import Arg, Script
from celery_redlock.core.quorum import Votes, agreed_too_late, check_node_timeout
from celery_redlock.core.redlock import ATTEMPT_SEPARATOR
from celery_redlock.core.replies import (
    Holder,
    as_bytes,
    holder_of,
    most_common_holder,
    refusal_of_acquire,
)
from celery_redlock.core.scripts import ACQUIRE, RAISE_FENCE, RELEASE
from celery_redlock.core.through_client import NotSent

from .lock import Lock
from .masters import Masters, Round
from .ordering import MAX_PENDING as MAX_PENDING  # documented here, in docs/asyncio.md
from .renewal import Renewer
from .task_state import TaskState

__all__ = ["Redlock"]


class Redlock(Lock):
    """A lock held on a majority of independent ``redis.asyncio`` masters.

    After ``masters`` it takes :class:`celery_redlock.asyncio.Lock`'s arguments;
    ``sleep`` is the mean pause between attempts (each drawn between half and
    one and a half of it, so contenders stop splitting the vote). As with
    :class:`celery_redlock.Redlock`, an ``async with`` block that cannot take
    the lock raises :class:`~celery_redlock.core.exceptions.QuorumNotAchieved`
    (not :class:`~celery_redlock.core.exceptions.LockNotAcquired`), whose ``errors``
    give each master's reason and ``holder`` the value most masters hold.

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
        self.node_timeout = check_node_timeout(node_timeout, self.timeout)
        self._masters = Masters(masters, name, self.node_timeout)
        twice = [n for n, count in Counter(self._masters.names).items() if count > 1]
        if twice:
            raise ConfigurationError("masters", twice, "name the same server more than once")
        self.masters = tuple(masters)

    @property
    def quorum(self) -> int:
        """How many masters must agree: more than half of them."""
        return self._masters.quorum

    @property
    def nodes(self) -> tuple[str, ...]:
        """The masters' names, as used in :attr:`QuorumNotAchieved.errors`."""
        return self._masters.names

    def _retry_delay(self, sleep: Number) -> float:
        # Contenders retrying in step keep splitting the vote (not a secret: ``random`` is fine).
        return float(sleep) * random.uniform(0.5, 1.5)

    def _encode_token(self, token: str | bytes) -> bytes:
        # Masters may differ in encoding options: send UTF-8, redis-py's default.
        return token.encode() if isinstance(token, str) else bytes(token)

    def _renewer(self) -> Renewer:
        return self._masters.renew

    @property
    def _inline(self) -> bool:
        # A fan-out to several masters cannot be handed over mid-flight.
        return False

    def _attempt_value(self, state: TaskState, token: bytes, retry: bool) -> bytes:
        """The value one attempt stores: the token, then ``token|N`` on retries (N from 2 up).

        As for :meth:`celery_redlock.Redlock._attempt_value`: the undo of a
        failed attempt may reach a master after the next attempt (behind an
        acquire whose wait the client's ``socket_timeout`` ended, or on a
        connection whose bytes are late), and with one value for both it
        would delete the next attempt's grant there. A value of each
        attempt's own makes any late undo harmless.

        Counted in the calling task's state: a retry, or a new ``acquire()``
        with the token of the task's last attempt, gets the next number. The
        count never restarts, not even for a new token, since tasks that share
        one state (``thread_local=False``) may interleave their attempts. The
        lease, hence :attr:`token` and the release, carries the value stored.
        """
        if not retry and token != state.tried:
            state.tried = token
            return token
        state.tried = token
        state.attempts += 1
        return b"%s%s%d" % (token, ATTEMPT_SEPARATOR, state.attempts)

    def _refused(self, state: TaskState, reply: Any) -> None:
        failure: QuorumNotAchieved = reply
        state.failure = failure
        state.holder = None if failure.holder is None else (failure.holder, failure.holder_ttl)

    def _not_acquired(self, state: TaskState) -> LockError:
        if state.failure is not None:
            return state.failure
        return QuorumNotAchieved(
            f"Unable to acquire lock {self.name} within the time specified", lock_name=self.name
        )

    async def _send_acquire(self, token: bytes) -> tuple[bool, Any]:
        masters = self._masters
        sent_at = self._clock()
        fences: dict[int, int] = {}
        granted: set[int] = set()
        holders: list[Holder] = []

        def agrees(i: int, reply: Any) -> bool:
            if isinstance(reply, list):  # the script's "held by" answer
                holders.append(holder_of(reply))
                return False
            if self.fencing:
                fences[i] = int(reply)
            granted.add(i)
            return True

        if self.fencing:
            keys: tuple[Arg, ...] = (self.name, self.fence_key)
            request = self._masters.script(
                ACQUIRE, keys, (token, self._ttl_ms, self._fence_retention_ms, "0")
            )
        else:
            request = self._masters.script(_SET_NX, (self.name,), (token, self._ttl_ms, "0"))
        grant, votes = await masters.vote(request, agrees, acquires=token)
        fence: int | None = None
        failure: QuorumNotAchieved | None = None
        if not votes.won:
            failure = masters.failure(f"Lock {self.name} not acquired", grant, votes, self._refusal)
        elif self.fencing:
            fence, failure = await self._hand_out_fence(token, fences)
        if failure is None and self.timeout is not None:
            left = sent_at + self.timeout - (self.timeout * self.drift_factor + 0.002)
            if left <= self._clock():
                failure = agreed_too_late(self.name, self._clock() - sent_at, self.timeout, votes)
        if failure is not None:
            await self._undo_grants(grant, granted, token)
            failure.holder, failure.holder_ttl = (
                most_common_holder(holders) if holders else (None, None)
            )
            return False, failure
        return True, fence

    def _refusal(self, reply: Any) -> LockError | None:
        return refusal_of_acquire(self.name, reply)

    async def _undo_grants(self, grant: Round, granted: set[int], token: bytes) -> None:
        """Release a failed acquisition on every master that holds or may yet hold it.

        Masters that said yes are released at once and awaited (within the node
        timeout), so a failed attempt leaves no key on a master that answered.
        Masters that failed may have run the acquire before failing, and those
        that have not answered may still run it: they get the release too,
        behind the acquire, and neither is awaited. An acquire never written
        (``NotSent``: its connection could not be opened) gets none: nothing
        of it can be there. A release queued behind an acquire still unanswered
        is not sent either if that acquire then fails so (see
        :class:`~.ordering.KeyQueue`).
        """
        undo = [
            i
            for i, outcome in enumerate(grant.outcomes)
            if i in granted
            or outcome is PENDING
            or (isinstance(outcome, BaseException) and not isinstance(outcome, NotSent))
        ]
        if not undo:
            return
        release = self._masters.send(
            self._masters.script(RELEASE, (self.name,), (token, "0")), only=undo, releases=token
        )
        awaited = Round(len(release.outcomes), {i: release.tasks[i] for i in granted})
        await self._masters.collect(awaited)

    async def _hand_out_fence(
        self, token: bytes, fences: dict[int, int]
    ) -> tuple[int | None, QuorumNotAchieved | None]:
        """Hand out the largest fence drawn, once a majority of counters holds it."""
        fence = max(fences.values())
        votes = Votes(len(self._masters.clients), sum(1 for f in fences.values() if f == fence))
        if votes.won:
            return fence, None
        others = [i for i in range(votes.size) if fences.get(i) != fence]
        request = self._masters.script(
            RAISE_FENCE, (self.name, self.fence_key), (token, fence, self._fence_retention_ms)
        )
        raise_ = self._masters.send(request, only=others)
        await self._masters.collect(raise_, votes.settle(lambda i, reply: reply == 1))
        if votes.won:
            return fence, None
        return None, self._masters.failure(
            f"Lock {self.name} not acquired: fence {fence} not recorded",
            raise_,
            votes,
            lambda reply: None if reply == 1 else LockError("counter not raised", self.name),
        )

    async def _send_release(self, token: bytes) -> bool:
        round_, votes = await self._masters.vote(
            self._masters.script(RELEASE, (self.name,), (token, "0")),
            lambda i, reply: reply == 1,
            releases=token,
        )
        if votes.won:
            return True
        if votes.refused_by_majority:
            return False
        raise self._masters.failure(
            f"Cannot release lock {self.name}",
            round_,
            votes,
            lambda reply: None if reply == 1 else LockNotOwned("the token is not there", self.name),
        )

    async def _send_renew(self, lease: Lease, ms: int, replace: bool) -> int:
        return await self._masters.renew(lease, ms, replace)

    async def locked(self) -> bool:
        """Return ``True`` if one value is stored under the name on a majority of masters.

        Raises:
            QuorumNotAchieved: If too few masters answered to tell.
        """
        values: Counter[Any] = Counter()
        failed = 0

        def settle(i: int, outcome: Any) -> bool:
            nonlocal failed
            if isinstance(outcome, BaseException):
                failed += 1
            elif outcome is not None:
                values[as_bytes(outcome)] += 1
            return max(values.values(), default=0) >= self.quorum

        round_ = self._masters.send(self._get)
        await self._masters.collect(round_, settle)
        best = max(values.values(), default=0)
        if best >= self.quorum:
            return True
        unanswered = sum(1 for outcome in round_.outcomes if outcome is PENDING)
        if best + failed + unanswered >= self.quorum:
            raise self._masters.failure(
                f"Cannot tell whether lock {self.name} is held",
                round_,
                Votes(len(self._masters.clients), best),
                lambda reply: None,
            )
        return False

    async def _owned(self, state: TaskState | None) -> bool:
        token = (state or self._state()).token
        if token is None:
            return False
        round_, votes = await self._masters.vote(
            self._get, lambda i, value: as_bytes(value) == token
        )
        if votes.won or votes.refused_by_majority:
            return votes.won
        raise self._masters.failure(
            f"Cannot tell whether lock {self.name} is owned",
            round_,
            votes,
            lambda value: None if as_bytes(value) == token else LockNotOwned("not ours"),
        )

    async def _get(self, client: Any) -> Any:
        return await client.get(self.name)

    def __repr__(self) -> str:
        return (
            f"<asyncio Redlock {self.name!r} timeout={self.timeout} "
            f"masters={len(self._masters.clients)} quorum={self.quorum}>"
        )


def _set_nx_again(args: Sequence[Arg]) -> Sequence[Arg]:
    # The first send may have taken the lock: let the resend find it ours.
    return (args[0], args[1], "1")


# SET NX for Redlock without fencing, as a script so that every master's vote
# comes back through one path (and a refusal names the holder, as ACQUIRE does).
#
# KEYS[1]  lock key
# ARGV[1]  token
# ARGV[2]  ttl in milliseconds; "0" means the lock never expires
# ARGV[3]  "0" on the first send; "1" when this same acquisition is sent again
#          after its reply was lost (see Script), so it may find ARGV[1] held
# Returns  1 when the lock was taken (or, with ARGV[3] "1", already held with
#          ARGV[1]), otherwise {PTTL, holder's value}.
#
# Without ARGV[3] a resend after a lost reply met its own first send's key and
# answered "held by": the master then counted as refusing, and neither an
# undo nor the release went to it, leaving the key there until its TTL.
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
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] and ARGV[3] == '1' then
  -- Our own first send ran and its reply was lost: ours, with a fresh TTL.
  if tonumber(ARGV[2]) > 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return 1
end
return {redis.call('PTTL', KEYS[1]), holder}
""",
    resend=_set_nx_again,
)
