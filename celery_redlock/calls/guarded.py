"""The guarded call: acquire, resolve a refusal, run, release; once for every integration.

:func:`run_guarded` is the routine that the Celery task guard, RQ jobs and the
:func:`~celery_redlock.singleton` decorator all drive (its asyncio twin is
:mod:`celery_redlock.calls.guarded_async`). What differs between them is a
:class:`Guard`: how a lock is built, what a refused or unreachable call does,
and what to report. The routine owns the order of events, which is what the
guarantees rest on: the lease is current (``current_lock()``) exactly while
the body runs, and the lock is released in the body's ``finally`` whatever
the body did, before the caller sees its outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from redis.exceptions import RedisError

from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import LockError, LockNotOwned
from celery_redlock.core.lock import Lease
from celery_redlock.core.rate import RateLimiter, RateVerdict

from .context import RateSlot, holding, rated

__all__ = ["UNPROTECTED", "Call", "Guard", "Releasing", "run_guarded", "run_unprotected"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One call under guard: its lock key, the value its lock will carry, and its name in logs.

    Attributes:
        key: The lock key.
        token: The lock value (a :class:`~celery_redlock.core.holder.Holder`, encoded).
        label: How log lines name the call (``task add[1f3c]``).
        call_id: The call's id (task or job id), if it has one: a refusal by a
            holder with the same id is the call's own earlier delivery.
        rate_key: The call's rate key, when it has a rate limit: checked
            before the lock (see :meth:`Guard.rate_limiter`).
    """

    key: str
    token: str
    label: str
    call_id: str | None = None
    rate_key: str | None = None


class _Unprotected:
    """The answer of :meth:`Guard.store_failed` that runs the body without a lock."""

    def __repr__(self) -> str:
        return "UNPROTECTED"


#: Returned by :meth:`Guard.store_failed` to run the body without the lock.
UNPROTECTED: Any = _Unprotected()


class Guard(Generic[T]):
    """What an integration supplies to :func:`run_guarded`.

    Subclasses build the lock (:meth:`new_lock`) and decide what a refused
    call (:meth:`refused`) and a failed store (:meth:`store_failed`) do: each
    returns the call's result, or raises. The other hooks default to doing nothing.
    """

    #: How a lost lock's log line names the holder (``task``, ``job``, ``call``).
    kind = "call"
    #: Where the routine logs: the integration's own logger, so its users configure one.
    log = logger

    def new_lock(self, call: Call) -> Any:
        """Build the lock of ``call`` (may raise ``RedisError``: a Cluster client connects)."""
        raise NotImplementedError

    def refused(self, call: Call, lock: Any) -> T:
        """Resolve a call whose acquire was refused (``lock.refusal`` says by whom)."""
        raise NotImplementedError

    def rate_limiter(self, call: Call) -> RateLimiter:
        """The limiter of a call with a ``rate_key`` (may raise ``RedisError``)."""
        raise NotImplementedError

    def rate_limited(self, call: Call, verdict: RateVerdict) -> T:
        """Resolve a call over its rate limit (``verdict.wait``: seconds until a slot frees)."""
        raise NotImplementedError

    def store_failed(self, call: Call, exc: RedisError) -> T:
        """Resolve a call whose store failed: return its result, :data:`UNPROTECTED`, or raise."""
        raise exc

    def ran_unprotected(self, call: Call) -> None:
        """Called after a body that :meth:`store_failed` let run without the lock."""

    def acquired(self, call: Call, lease: Lease) -> None:
        """Called once the lock is held, before the body runs."""

    def starting(self, call: Call, lease: Lease) -> None:
        """Called inside the lock, just before the body (may raise to skip the body)."""

    def release(self, call: Call, lock: Any, lease: Lease) -> bool:
        """Release the lock after the body; return whether it was still the call's."""
        outcome = Releasing(lease, self.kind, self.log)
        with outcome:
            lock.release()
        return outcome.owned


def run_guarded(guard: Guard[Any], call: Call, body: Callable[[], T]) -> T:
    """Run ``body`` while holding the lock of ``call``, or let ``guard`` resolve why not.

    A call with a rate key is first admitted by its rate limit (one round
    trip); one over the limit goes to :meth:`Guard.rate_limited`, and an
    admission whose lock is then refused is taken back.
    """
    limiter: RateLimiter | None = None
    verdict: RateVerdict | None = None
    try:
        if call.rate_key is not None:
            limiter = guard.rate_limiter(call)
            verdict = limiter.acquire(call.rate_key, call.call_id)
        if verdict is None or verdict.admitted:
            lock = guard.new_lock(call)
            acquired = lock.acquire(token=call.token)
    except RedisError as exc:
        return run_unprotected(guard, call, exc, body)
    slot = None
    if limiter is not None and verdict is not None and call.rate_key is not None:
        if not verdict.admitted:
            return guard.rate_limited(call, verdict)  # type: ignore[no-any-return]
        slot = RateSlot(call.rate_key, limiter, verdict)
    if not acquired:
        _refund(slot)
        return guard.refused(call, lock)  # type: ignore[no-any-return]
    lease = lock.lease
    guard.acquired(call, lease)
    try:
        with holding(lease), rated(slot):
            guard.starting(call, lease)
            return body()
    finally:
        guard.release(call, lock, lease)


def _refund(slot: RateSlot | None) -> None:
    """Give back a rate admission whose call did not start; a failure only wastes the slot."""
    if slot is None:
        return
    try:
        slot.limiter.refund(slot.key, slot.verdict)
    except RedisError as exc:
        logger.warning("could not give back a slot of %s (%s)", slot.key, describe_error(exc))


def run_unprotected(guard: Guard[Any], call: Call, exc: RedisError, body: Callable[[], T]) -> T:
    """After a store failure: :meth:`Guard.store_failed`'s outcome, or ``body`` without a lock."""
    outcome = guard.store_failed(call, exc)
    if outcome is not UNPROTECTED:
        return outcome  # type: ignore[no-any-return]
    try:
        return body()
    finally:
        guard.ran_unprotected(call)


class Releasing:
    """Wraps a lock's release after its call; ``owned`` says whether it was still the call's.

    A release that fails never masks the call's outcome: the ``with`` block
    swallows the failure after logging it, a lock found lost as an ERROR (the
    call ran part of its time unprotected), a store that could not be reached
    as a WARNING (the key expires within its TTL).
    """

    def __init__(self, lease: Lease, kind: str, log: logging.Logger = logger) -> None:
        self.lease = lease
        self.kind = kind
        self.log = log
        self.owned = True

    def __enter__(self) -> Releasing:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        lease = self.lease
        if isinstance(error, LockNotOwned):
            self.owned = False
            self.log.error("%s was lost before the %s finished", lease.describe(), self.kind)
        elif isinstance(error, (RedisError, LockError)):
            self.log.warning(
                "%s: release failed (%s); it expires within %ss",
                lease.describe(),
                describe_error(error),
                lease.ttl,
            )
        elif error is None:
            self.log.debug("%s released", lease.describe())
        else:
            return False  # anything else is a bug: let it through
        return True
