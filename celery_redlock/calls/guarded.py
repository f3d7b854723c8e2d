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
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from redis.exceptions import RedisError

from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import LockError, LockNotOwned
from celery_redlock.core.lock import Lease
from celery_redlock.core.queue_scripts import Place
from celery_redlock.core.rate import RateVerdict

from .context import RateSlot, hold, holding, let_go, rated

__all__ = ["UNPROTECTED", "Call", "Guard", "release_failed", "run_guarded", "run_unprotected"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Call:
    """One call under guard: its lock key, the value its lock will carry, and its name in logs.

    A plain class with slots rather than a frozen dataclass: one is built for
    every task, and a frozen dataclass sets each field through
    ``object.__setattr__``.

    Attributes:
        key: The lock key.
        token: The lock value (a :class:`~celery_redlock.core.holder.Holder`, encoded).
        label: How log lines name the call (``task add[1f3c]``).
        call_id: The call's id (task or job id), if it has one: a refusal by a
            holder with the same id is the call's own earlier delivery.
        rate_key: The call's rate key, when it has a rate limit: checked
            before the lock (see :meth:`Guard.rate_limiter`).
        place: The call's place in its key's wait line, when it waits in line
            (a requeued Celery call): the lock is then taken in arrival order.
    """

    __slots__ = ("call_id", "key", "label", "place", "rate_key", "token")

    def __init__(
        self,
        key: str,
        token: str,
        label: str,
        call_id: str | None = None,
        rate_key: str | None = None,
    ) -> None:
        self.key = key
        self.token = token
        self.label = label
        self.call_id = call_id
        self.rate_key = rate_key
        self.place: Place | None = None

    def __repr__(self) -> str:
        return f"Call({self.key!r}, label={self.label!r}, call_id={self.call_id!r})"


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

    def rate_limiter(self, call: Call) -> Any:
        """The limiter of a call with a ``rate_key`` (may raise ``RedisError``).

        A :class:`~celery_redlock.core.rate.RateLimiter`, or its asyncio twin
        (:class:`celery_redlock.asyncio.rate.RateLimiter`) for the asyncio routine.
        """
        raise NotImplementedError

    def rate_limited(self, call: Call, verdict: RateVerdict) -> T:
        """Resolve a call over its rate limit (``verdict.wait``: seconds until a slot frees)."""
        raise NotImplementedError

    def rate_retry_in(self, call: Call, verdict: RateVerdict, waited: float) -> float | None:
        """Seconds to wait in place before asking the rate limit again, or ``None``.

        ``None`` (the default) hands the call to :meth:`rate_limited` at once;
        a number makes the routine sleep that long (``asyncio.sleep`` in the
        asyncio twin) and try again. ``waited``: seconds this call has waited so far.
        """
        return None

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
        try:
            lock.release()
        except (RedisError, LockError) as error:
            return release_failed(lease, self.kind, error, self.log)
        if self.log.isEnabledFor(logging.DEBUG):
            self.log.debug("%s released", lease.describe())
        return True


def run_guarded(guard: Guard[Any], call: Call, body: Callable[[], T]) -> T:
    """Run ``body`` while holding the lock of ``call``, or let ``guard`` resolve why not.

    A call with a rate key is first admitted by its rate limit (see
    :func:`_run_rated`); without one this is the plain path, and the rate
    costs it one test.
    """
    if call.rate_key is not None:
        return _run_rated(guard, call, call.rate_key, body)
    try:
        lock = guard.new_lock(call)
        acquired = _acquire(lock, call)
    except RedisError as exc:
        return run_unprotected(guard, call, exc, body)
    if not acquired:
        return guard.refused(call, lock)  # type: ignore[no-any-return]
    lease = lock.lease
    guard.acquired(call, lease)
    try:
        held = hold(lease)
        try:
            guard.starting(call, lease)
            return body()
        finally:
            let_go(held)
    finally:
        guard.release(call, lock, lease)


def _acquire(lock: Any, call: Call) -> bool:
    """One attempt at ``call``'s lock: in line when the call has a place (may raise RedisError)."""
    if call.place is None:
        return bool(lock.acquire(token=call.token))
    return bool(lock.acquire(token=call.token, place=call.place))


def _run_rated(guard: Guard[Any], call: Call, rate_key: str, body: Callable[[], T]) -> T:
    """:func:`run_guarded` for a call with a rate key: admitted by its limit, then locked.

    The admission is one round trip; a call over the limit waits in place when
    :meth:`Guard.rate_retry_in` says so (exactly until a slot frees), else goes
    to :meth:`Guard.rate_limited`; an admission whose lock is then refused is
    taken back. A lock that waits for its holder is taken first (see
    :func:`_run_rated_after_lock`).
    """
    started = time.monotonic()
    try:
        lock = guard.new_lock(call)
        if getattr(lock, "blocking", False):
            return _run_rated_after_lock(guard, call, rate_key, lock, body)
        slot = _admit(guard, call, rate_key, started)
        acquired = slot.verdict.admitted and _acquire(lock, call)
    except RedisError as exc:
        return run_unprotected(guard, call, exc, body)
    if not slot.verdict.admitted:
        return guard.rate_limited(call, slot.verdict)  # type: ignore[no-any-return]
    if not acquired:
        _refund(slot)
        return guard.refused(call, lock)  # type: ignore[no-any-return]
    return _run_holding(guard, call, lock, slot, body)


def _run_rated_after_lock(
    guard: Guard[Any], call: Call, rate_key: str, lock: Any, body: Callable[[], T]
) -> T:
    """Wait for the lock, then for a rate slot, then run: the start falls in the window counted.

    A slot taken before a long wait for the lock would count the start in a
    window the call no longer starts in, letting more than the rate start in a
    later one. The lock is renewed while the call waits for its slot.
    """
    started = time.monotonic()
    if not _acquire(lock, call):
        return guard.refused(call, lock)  # type: ignore[no-any-return]
    try:
        slot = _admit(guard, call, rate_key, started)
    except RedisError as exc:
        guard.release(call, lock, lock.lease)
        return run_unprotected(guard, call, exc, body)
    if not slot.verdict.admitted:
        guard.release(call, lock, lock.lease)
        return guard.rate_limited(call, slot.verdict)  # type: ignore[no-any-return]
    return _run_holding(guard, call, lock, slot, body)


def _admit(guard: Guard[Any], call: Call, rate_key: str, started: float) -> RateSlot:
    """Ask the rate limit until it admits or the guard stops waiting (may raise RedisError)."""
    limiter = guard.rate_limiter(call)
    while True:
        verdict = limiter.acquire(rate_key, call.call_id)
        if verdict.admitted:
            return RateSlot(rate_key, limiter, verdict)
        delay = guard.rate_retry_in(call, verdict, time.monotonic() - started)
        if delay is None:
            return RateSlot(rate_key, limiter, verdict)
        time.sleep(delay)


def _run_holding(
    guard: Guard[Any], call: Call, lock: Any, slot: RateSlot, body: Callable[[], T]
) -> T:
    """Run ``body`` under the lock just taken and the rate slot just admitted; release after."""
    lease = lock.lease
    guard.acquired(call, lease)
    try:
        with holding(lease), rated(slot):
            guard.starting(call, lease)
            return body()
    finally:
        guard.release(call, lock, lease)


def _refund(slot: RateSlot) -> None:
    """Give back a rate admission whose call did not start; a failure only wastes the slot."""
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


def release_failed(
    lease: Lease, kind: str, error: BaseException, log: logging.Logger = logger
) -> bool:
    """Log a release that failed after its call; return whether the lock was still the call's.

    A release that fails never masks the call's outcome: a lock found lost is
    logged as an ERROR (the call ran part of its time unprotected), a store that
    could not be reached as a WARNING (the key expires within its TTL).
    """
    if isinstance(error, LockNotOwned):
        log.error("%s was lost before the %s finished", lease.describe(), kind)
        return False
    log.warning(
        "%s: release failed (%s); it expires within %ss",
        lease.describe(),
        describe_error(error),
        lease.ttl,
    )
    return True
