"""Redlock: one lock over N independent Redis masters, held while a majority grants it.

:class:`Redlock` has :class:`~celery_redlock.core.lock.Lock`'s interface; each
operation goes to every master at once and is decided by a majority (more than
half of the masters):

- acquire: ``SET NX PX`` (with the fence, see below) on every master; held when
  a majority said yes with validity left, ``ttl - elapsed - (ttl * drift + 2 ms)``
  counted from before sending. Otherwise the acquisition is undone on every
  master that granted it or did not answer clearly.
- release / extend / reacquire / renewal: compare-and-delete or
  compare-and-``PEXPIRE`` on every master; a majority must agree.

How requests reach the masters: :mod:`~celery_redlock.core.fanout` sends one
request to every master at once and reads the replies as they arrive;
:mod:`~celery_redlock.core.quorum` counts the votes; :mod:`~celery_redlock.core.nodes`
keeps each master's connections.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .exceptions import (
    ConfigurationError,
    LockError,
    LockNotOwned,
    QuorumNotAchieved,
)
from .fanout import NOT_ASKED, PENDING, Round
from .lock import Lock
from .lock_options import Number
from .nodes import Master, bounded_client, node_for
from .quorum import Masters, Votes, agreed_too_late, check_node_timeout
from .redlock_lease import RedlockLease
from .replies import Holder, as_bytes, holder_of, most_common_holder, refusal_of_acquire
from .scripts import ACQUIRE, RAISE_FENCE, RELEASE
from .shot import Shot
from .through_client import NotSent
from .wire import Request, Template

__all__ = ["Redlock", "RedlockLease", "bounded_client"]

logger = logging.getLogger(__name__)

#: Joins a token and the number of a later attempt made with it (``token|2``).
#: A lock value written by :class:`~celery_redlock.core.holder.Holder` keeps parsing:
#: its fields never hold a bare ``|``, so a trailing number reads as the attempt.
ATTEMPT_SEPARATOR = b"|"


class _Attempts(threading.local):
    # The token this thread last tried, and how many attempts were made with it.
    token: bytes | None = None
    count: int = 0


class Redlock(Lock):
    """A lock held on a majority of independent Redis masters (the Redlock algorithm).

    ``Redlock(masters, name, timeout=None, sleep=0.1, blocking=True,
    blocking_timeout=None, thread_local=True, raise_on_release_error=True, *,
    auto_renew=False, on_lost=None, fencing=True, drift_factor=0.01,
    node_timeout=None, watchdog=None, clock=time.monotonic, label=None)``:
    after ``masters`` it takes :class:`~celery_redlock.core.lock.Lock`'s arguments
    (see there), with these differences:

    - ``sleep`` is the mean pause between attempts while blocking; each pause
      is drawn between half and one and a half of it, so that contenders stop
      splitting the vote;
    - ``clock`` measures validity only: socket waits use ``time.monotonic``;
    - ``fence_key`` names the counter on every master.

    Release, extend and reacquire raise :class:`QuorumNotAchieved` when too few
    masters answer to tell whether the lock is still held. See
    ``docs/redlock.md`` for what the lock and its fence guarantee.

    Args:
        masters: ``redis.Redis`` clients or ``redis://`` URLs, one per independent
            master (not replicas of one another, not one Redis Cluster).
        name: The Redis key of the lock, the same on every master.
        *args: :class:`~celery_redlock.core.lock.Lock`'s positional arguments after ``name``.
        node_timeout: Longest wait for one master, in seconds; by default a tenth
            of the TTL within 50 ms and 1 s. Must be shorter than the TTL.
        **options: :class:`~celery_redlock.core.lock.Lock`'s keyword-only arguments.

    Raises:
        ConfigurationError: If an argument is out of range, naming it.
    """

    def __init__(
        self,
        masters: Sequence[Master],
        name: str,
        *args: Any,
        node_timeout: Number | None = None,
        **options: Any,
    ) -> None:
        # Everything but the masters and the node timeout is Lock's, validated there.
        super().__init__(None, name, *args, **options)
        if isinstance(masters, (str, bytes)) or not masters:
            raise ConfigurationError(
                "masters", masters, "must be a non-empty list of clients or URLs"
            )
        self.node_timeout = check_node_timeout(node_timeout, self.timeout)
        nodes = [node_for(master, self.node_timeout) for master in masters]
        servers = Counter(node.server for node in nodes)
        twice = [server for server, count in servers.items() if count > 1]
        if twice:
            # Two entries for one server (say two of its databases) would give
            # it two votes, and its failure would cost two.
            raise ConfigurationError("masters", twice, "name the same server more than once")
        self.masters = tuple(masters)
        self._masters = Masters(nodes, self.node_timeout)
        # Every acquire and release sends the same command but for the token.
        self._grant = self._grant_template()
        self._release = Template(("EVAL", RELEASE.source, 1, self.name, b"", "0"), 4, RELEASE)
        self._attempts = _Attempts()

    @property
    def quorum(self) -> int:
        """How many masters must agree: more than half of them."""
        return self._masters.quorum

    @property
    def nodes(self) -> tuple[str, ...]:
        """The masters' names, as used in :attr:`QuorumNotAchieved.errors`."""
        return tuple(node.name for node in self._masters.nodes)

    # -- hooks of Lock ----------------------------------------------------------------

    def _encode_token(self, token: str | bytes) -> bytes:
        # No client to ask: tokens are sent as UTF-8, redis-py's default encoding.
        return token.encode() if isinstance(token, str) else bytes(token)

    def _retry_delay(self, sleep: Number) -> float:
        # Contenders that all retry after the same pause keep splitting the vote;
        # a random pause lets one of them reach the majority first. (Not a secret:
        # the ``random`` module is fine here.)
        return float(sleep) * random.uniform(0.5, 1.5)

    def _not_acquired(self) -> LockError:
        failure = self.local.failure
        if failure is not None:
            return failure
        return QuorumNotAchieved(
            f"Unable to acquire lock {self.name} within the time specified", lock_name=self.name
        )

    def _attempt_value(self, token: bytes) -> bytes:
        """The value one attempt stores: the token, then ``token|2``, ``token|3``... on retries.

        A failed attempt is undone with a compare-and-delete that reaches some
        masters unawaited, behind its acquire on that acquire's connection. The
        next attempt goes out on other connections, so a master can run it
        first: with one value for both, the late undo would delete the next
        attempt's grant, and a second client could take the lock while this
        one believes it holds it. Routing the next attempt through the
        connection that carries the undo would not do: that connection is
        closed once its master has been silent for the node timeout, and bytes
        already sent still arrive; a master reached through a client on the
        thread pool has no such connection at all. A value of each attempt's
        own makes any late undo harmless, however it travels.

        Counted per thread, for one token after another: a retry, or a new
        ``acquire()`` with the token of the last one, gets the next number. The
        lease (hence :attr:`token` and the release) carries the value stored.
        """
        attempts = self._attempts
        if attempts.token != token:
            attempts.token, attempts.count = token, 1
            return token
        attempts.count += 1
        return b"%s%s%d" % (token, ATTEMPT_SEPARATOR, attempts.count)

    def do_acquire(self, token: bytes) -> bool:
        """Make one attempt on every master; on success store the new lease for this thread.

        The value stored is ``token``, or on a later attempt with the same
        token ``token|N`` (see :meth:`_attempt_value`).
        """
        token = self._attempt_value(token)
        masters = self._masters
        sent_at = self._clock()
        lease = self._new_lease(RedlockLease, masters, token, None, sent_at)
        grant, votes = masters.open_vote(self._grant, token)
        try:
            granted, fences, holders = self._read_grants(grant.outcomes)
            failure: QuorumNotAchieved | None = None
            if not votes.won:
                failure = masters.failure(
                    f"Lock {self.name} not acquired", self.name, grant, votes, self._refusal
                )
            elif self.fencing:
                lease.fence, failure = self._hand_out_fence(token, fences)
            if failure is None and not lease.valid:
                failure = agreed_too_late(self.name, self._clock() - sent_at, self.timeout, votes)
            if failure is not None:
                self._undo(grant, granted, token)
            else:
                # A lock shared by threads may be released by another thread:
                # its stragglers are parked where any thread can claim them.
                lease.stragglers = grant.finish(reserve=True, any_thread=not self.thread_local)
        finally:
            grant.finish()
        self.local.holder = most_common_holder(holders) if holders else None
        if failure is not None:
            failure.holder, failure.holder_ttl = self.local.holder or (None, None)
            self.local.failure = failure
            holder = f" for {self.label}" if self.label else ""
            logger.debug("lock %s not acquired%s: %s", self.name, holder, failure)
            return False
        self.local.failure = None
        self.local.lease = lease
        return True

    def _read_grants(self, outcomes: list[Any]) -> tuple[set[int], dict[int, int], list[Holder]]:
        """What an acquire's replies say: who granted it, their fences, the holders seen."""
        granted: set[int] = set()
        fences: dict[int, int] = {}
        holders: list[Holder] = []
        fencing = self.fencing
        for i, reply in enumerate(outcomes):
            if type(reply) is int:  # the acquire script's fence
                granted.add(i)
                if fencing:
                    fences[i] = reply
            elif reply is None or reply is PENDING or reply is NOT_ASKED:
                continue  # SET NX refused, or no answer
            elif type(reply) is list:  # the acquire script's "held by" answer
                holders.append(holder_of(reply))
            elif not isinstance(reply, BaseException):  # SET NX's OK
                granted.add(i)
                if fencing:
                    fences[i] = int(reply)
        return granted, fences, holders

    def _grant_template(self) -> Template:
        if self.fencing:
            return Template(
                ("EVALSHA", ACQUIRE.sha, 2, self.name, self.fence_key, b"", self._ttl_ms,
                 self._fence_retention_ms, "0"),
                5,
                ACQUIRE,
            )  # fmt: skip
        if self._ttl_ms:
            return Template(("SET", self.name, b"", "NX", "PX", self._ttl_ms), 2)
        return Template(("SET", self.name, b"", "NX"), 2)

    def _refusal(self, reply: Any) -> LockError | None:
        return refusal_of_acquire(self.name, reply)

    def _hand_out_fence(
        self, token: bytes, fences: dict[int, int]
    ) -> tuple[int | None, QuorumNotAchieved | None]:
        """Pick the fence and make sure a majority of masters holds it or more.

        Each master drew its own fence; the largest is handed out. Any later
        acquisition's majority shares a master with the majority that holds this
        fence, where it draws (or raises the counter to) a larger one. Masters
        whose counter this acquisition has just drawn to exactly the fence already
        hold it; usually all do, and no second round trip is needed.
        """
        drawn = list(fences.values())
        fence = max(drawn)
        holding = drawn.count(fence)
        if holding >= self._masters.quorum:
            return fence, None
        votes = Votes(len(self._masters.nodes), holding)
        request = Request.run(
            RAISE_FENCE, (self.name, self.fence_key), (token, fence, self._fence_retention_ms)
        )
        requests = [None if fences.get(i) == fence else request for i in range(votes.size)]
        with self._masters.ask(requests) as raise_:
            raise_.collect(votes.settle(lambda i, reply: reply == 1))
        if votes.won:
            return fence, None
        return None, self._masters.failure(
            f"Lock {self.name} not acquired: fence {fence} not recorded",
            self.name,
            raise_,
            votes,
            lambda reply: None if reply == 1 else LockError("counter not raised", self.name),
        )

    def _undo(self, grant: Round | Shot, granted: set[int], token: bytes) -> None:
        """Release a failed acquisition on every master that may hold it.

        Masters that have not answered get the release on the same connection,
        right behind the acquire, and are not waited for. Masters that failed
        may have run the acquire before failing, so they get it too, unawaited,
        unless it was never sent to them (``NotSent``). Masters that refused
        hold nothing of ours. Only the release on masters that said yes is
        awaited (within the node timeout), so a failed attempt leaves no key
        behind on a master that answered.
        """
        release = self._release.request(token)
        grant.finish(follow_up=release)
        requests = [
            release
            if i in granted
            or (isinstance(outcome, BaseException) and not isinstance(outcome, NotSent))
            else None
            for i, outcome in enumerate(grant.outcomes)
        ]
        waiting = set(granted)

        def settle(i: int, outcome: Any) -> bool:
            waiting.discard(i)
            return not waiting

        with self._masters.ask(requests) as undo:
            if waiting:
                undo.collect(settle)

    def do_release(self, expected_token: bytes) -> None:
        """Delete the lock on every master that holds ``expected_token``.

        Raises:
            LockNotOwned: If a majority does not hold the token, or the lease
                was lost or outlived its validity.
            QuorumNotAchieved: If too few masters answered to tell.
        """
        lease = self.local.lease
        claims: dict[int, Any] = {}
        if isinstance(lease, RedlockLease) and lease.token == expected_token:
            claims, lease.stragglers = lease.stragglers, {}
        round_, votes = self._masters.open_vote(self._release, expected_token, claims, 1)
        round_.finish()
        # A lease already found lost stays lost: a master reached again after a
        # restart counts a missing key as released when the release is resent
        # after a lost reply (see scripts.RELEASE), which is no sign of holding it.
        if votes.won and not (lease is not None and lease.lost):
            return
        # A lease past its validity is not ours whatever the masters that did
        # not answer might hold: report it lost rather than "cannot tell".
        expired = lease is not None and (
            lease.lost or (lease.deadline is not None and lease.deadline <= self._clock())
        )
        if votes.refused_by_majority or expired:
            if lease is not None:
                lease.lost = True
                lease.loss_reason = lease.loss_reason or "not owned at release"
            raise LockNotOwned("Cannot release a lock that's no longer owned", lock_name=self.name)
        raise self._masters.failure(
            f"Cannot release lock {self.name}",
            self.name,
            round_,
            votes,
            lambda reply: (
                None if reply == 1 else LockNotOwned("the token is not there", lock_name=self.name)
            ),
        )

    def _renew(self, ms: int, replace: bool, operation: str) -> None:
        lease = self.local.lease
        assert isinstance(lease, RedlockLease)
        lease.renew_for(ms, replace, operation)

    def locked(self) -> bool:
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
                values[outcome] += 1
            return bool(values) and max(values.values()) >= self.quorum

        with self._masters.ask(Request(("GET", self.name))) as round_:
            round_.collect(settle)
        best = max(values.values(), default=0)
        if best >= self.quorum:
            return True
        unanswered = sum(1 for outcome in round_.outcomes if outcome is PENDING)
        if best + failed + unanswered >= self.quorum:
            votes = Votes(len(self._masters.nodes), best)
            raise self._masters.failure(
                f"Cannot tell whether lock {self.name} is held",
                self.name,
                round_,
                votes,
                lambda reply: None,
            )
        return False

    def owned(self) -> bool:
        """Return ``True`` if this thread's token is stored on a majority of masters.

        Raises:
            QuorumNotAchieved: If too few masters answered to tell.
        """
        token = self.local.token
        if token is None:
            return False
        round_, votes = self._masters.vote(
            Request(("GET", self.name)), lambda i, value: as_bytes(value) == token
        )
        if votes.won or votes.refused_by_majority:
            return votes.won
        raise self._masters.failure(
            f"Cannot tell whether lock {self.name} is owned",
            self.name,
            round_,
            votes,
            lambda value: None if as_bytes(value) == token else LockNotOwned("not ours"),
        )

    def __repr__(self) -> str:
        return (
            f"<Redlock {self.name!r} timeout={self.timeout} "
            f"masters={len(self._masters.nodes)} quorum={self.quorum}>"
        )
