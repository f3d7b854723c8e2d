"""The worker side of the enqueue windows: a reserved message takes over its reservation.

``until_executing``, ``until_executed`` and ``until_and_while_executing``
reserve a call's key when it is published (:mod:`celery_redlock.celery.publish`).
When the message reaches a worker, :class:`EnqueueGuard` drops the reservation
(``until_executing``) or turns it into the execution lock in one Lua call
(:class:`HandoverLock`, the other two), and reports a reservation that lapsed.
A running ``until_executed`` attempt that published its own retry hands its
lock to that retry when it ends (:func:`hand_over_at_end`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from redis.exceptions import RedisError

from celery_redlock.calls.decisions import Decision
from celery_redlock.calls.guarded import UNPROTECTED, Call, run_unprotected
from celery_redlock.core.error_text import describe_error
from celery_redlock.core.holder import Holder, Refusal
from celery_redlock.core.lock import Lease, Lock
from celery_redlock.core.scripts import RELEASE
from celery_redlock.core.window_scripts import DEQUEUE, HANDOVER, RESERVE

from . import signals
from .guard import TaskGuard
from .messages import CONTINUES_HEADER, REQUEUES_HEADER, RESERVATION_HEADER, header_of

__all__ = [
    "UNTIL_EXECUTED",
    "UNTIL_EXECUTING",
    "UNTIL_EXPIRED",
    "EnqueueGuard",
    "HandoverLock",
    "hand_over_at_end",
    "release_revoked",
    "reservation_key",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The window that ends when the run starts: the worker drops the reservation.
UNTIL_EXECUTING = "until_executing"
#: The window whose reservation becomes the execution lock (same key).
UNTIL_EXECUTED = "until_executed"
#: The window whose reservation lasts its period, whatever the worker does.
UNTIL_EXPIRED = "until_expired"

# Leases of until_executed attempts that published their own retry: when the
# attempt ends, its lock becomes the retry's reservation (value, monotonic
# deadline) instead of being released.
_handovers: weakref.WeakKeyDictionary[Lease, tuple[str, float]] = weakref.WeakKeyDictionary()


def reservation_key(mode: str, key: str) -> str:
    """Return the key a call's enqueue lock lives under.

    ``until_executed`` reserves the lock key itself: the reservation becomes
    the execution lock. The other modes reserve a sibling in the same hash
    slot, so a copy can be queued while another runs; ``until_expired`` a
    sibling that only its period ends.
    """
    if mode == UNTIL_EXECUTED:
        return key
    return f"{key}:period" if mode == UNTIL_EXPIRED else f"{key}:queued"


def hand_over_at_end(lease: Lease, value: str, ttl_ms: int) -> None:
    """Make the running attempt's lock become reservation ``value`` when the attempt ends.

    See :meth:`EnqueueGuard.release`: the swap is one compare-and-set, and
    the reservation lasts ``ttl_ms`` from now.
    """
    _handovers[lease] = (value, time.monotonic() + ttl_ms / 1000)


def _decode(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _refusal(pttl_ms: int, held: Any) -> Refusal:
    return Refusal(_decode(held), pttl_ms / 1000 if pttl_ms >= 0 else None)


class HandoverLock(Lock):
    """The execution lock of a task whose message reserved its key at publish time.

    Taking it turns the message's reservation into the execution lock in one
    ``HANDOVER`` call. Everything else (lease, renewal, release) is
    :class:`~celery_redlock.core.lock.Lock`'s.

    Args:
        redis: The lock store's client.
        name: The lock key.
        reservation_key: Where the message's reservation lives.
        reservation: The reservation value the message carries, if any.
        on_lapsed: Called when the message carries a reservation that is gone.
        **kwargs: :class:`~celery_redlock.core.lock.Lock`'s options.
    """

    def __init__(
        self,
        redis: Any,
        name: str,
        *,
        reservation_key: str,
        reservation: str | None,
        on_lapsed: Callable[[], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(redis, name, **kwargs)
        self.reservation_key = reservation_key
        self.reservation = reservation
        self.on_lapsed = on_lapsed
        #: The message carried a reservation that was gone when it started.
        self.lapsed = False

    def do_acquire(self, token: bytes) -> bool:
        """Make one attempt; on success store the new lease for this thread."""
        sent_at = self._clock()
        status, first, second, *rest = HANDOVER(
            self.redis,
            (self.name, self.fence_key, self.reservation_key),
            (token, self._ttl_ms, self._fence_retention_ms, self.reservation or ""),
        )
        found = bool(rest[0]) if status == 0 else bool(second)
        if self.reservation and not found and not (status == 0 and _same_task(token, second)):
            # (An earlier attempt or delivery of this very task holding the key
            # is not a lapse: its lock passes to this message when it ends.)
            self.lapsed = True
            self.on_lapsed()
        if status == 0:
            self.local.holder = (_decode(second), first / 1000 if first >= 0 else None)
            return False
        self.local.holder = None
        self.local.lease = self._new_lease(Lease, self.redis, token, int(first), sent_at)
        return True


def _same_task(token: Any, held: Any) -> bool:
    """``True`` if two lock values name the same task id."""
    ours, theirs = Holder.parse(token), Holder.parse(held)
    return ours is not None and theirs is not None and ours.task_id == theirs.task_id


class EnqueueGuard(TaskGuard):
    """The guard of a task in an enqueue mode: it takes over the reservation its message made.

    ``until_executed`` and ``until_and_while_executing`` run the task under a
    :class:`HandoverLock`; ``until_executing`` drops the reservation and runs
    the task without a lock. A message that bypassed ``apply_async``
    (``send_task``, beat without the task registered) carries no reservation:
    it meets the lock like any duplicate would. A retry (``CONTINUES_HEADER``)
    may carry none either, and is never skipped.
    """

    @property
    def client(self) -> Any:
        """The lock store's client: enqueue modes run on one server (``conf.check_mode_store``)."""
        return self.store.client

    def run(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        body: Callable[[], Any],
        request: Any = None,
    ) -> Any:
        """Run ``body`` in this mode's window, or resolve the conflict (see :class:`TaskGuard`).

        ``until_expired`` costs the worker nothing: only the period ends its window.
        """
        if self.options.mode == UNTIL_EXPIRED:
            return body()
        if self.options.mode != UNTIL_EXECUTING:
            return super().run(args, kwargs, body, request)
        return self._dequeued(self._call(args, kwargs), body)

    def _dequeued(self, call: Call, body: Callable[[], T]) -> T:
        """``until_executing``: the reservation ends as the run starts; the run holds no lock."""
        request = self.task.request
        rkey = reservation_key(UNTIL_EXECUTING, call.key)
        value = header_of(request, RESERVATION_HEADER)
        try:
            reply = DEQUEUE(self.client, (rkey,), (value or "",))
        except RedisError as exc:
            return run_unprotected(self, call, exc, body)
        if value and reply != 1:
            # This call was reserved; a newer copy's reservation (if any) is
            # not a reason to drop it, and this mode has no execution lock.
            self._lapsed(rkey)
        elif isinstance(reply, list) and header_of(request, CONTINUES_HEADER):
            # A retry that went out while a newer copy held the key: the call
            # it continues already left the queue, so it is no duplicate.
            logger.debug(
                "%s: a retry; runs although %s is reserved by another copy", call.label, rkey
            )
        elif isinstance(reply, list):
            self._conflict(rkey, _refusal(*reply))
        return body()

    def new_lock(self, call: Call) -> Lock:
        """The execution lock, taken over from the message's reservation."""
        rkey = reservation_key(self.options.mode, call.key)
        return HandoverLock(
            self.client,
            call.key,
            reservation_key=rkey,
            reservation=header_of(self.task.request, RESERVATION_HEADER),
            on_lapsed=lambda: self._lapsed(rkey),
            **self._lock_options(call),
        )

    def refused(self, call: Call, lock: Any) -> NoReturn:
        """Never skip a lapsed copy or a retry; let a retry wait for its own attempt."""
        refusal = lock.refusal
        try:
            if lock.lapsed or header_of(self.task.request, CONTINUES_HEADER):
                self._never_skip(call.key, refusal)
            self._retry_waits(call.key, lock, refusal)
            self._conflict(call.key, refusal)
        finally:
            # until_and_while_executing: this copy ends (skip, raise) or was
            # republished with a new reservation (requeue); either way the one
            # its message made must not keep duplicates out.
            if lock.reservation_key != call.key and lock.reservation:
                try:
                    RELEASE(self.client, (lock.reservation_key,), (lock.reservation, "0"))
                except RedisError as exc:
                    logger.warning(
                        "could not drop reservation %s: %s",
                        lock.reservation_key,
                        describe_error(exc),
                    )

    def release(self, call: Call, lock: Any, lease: Lease) -> bool:
        """Release the lock, or hand it to the retry this attempt published."""
        handover = _handovers.pop(lease, None)
        if handover is None:
            return super().release(call, lock, lease)
        value, deadline = handover
        # Flag first, as a release does: the watchdog stops renewing, and a
        # renewal racing with the swap does not report the lock lost.
        lease.released = True
        lease.on_lost = None
        ttl_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            swapped: bool = RESERVE(self.client, (lease.name,), (value, ttl_ms, lease.token)) == 1
        except RedisError as exc:
            logger.warning(
                "%s: could not hand the lock to the retry (%s); it expires within %ss",
                lease.describe(),
                describe_error(exc),
                lease.ttl,
            )
            return True
        if swapped:
            logger.debug("%s was handed to the task's next attempt", lease.describe())
        else:
            logger.error("%s was lost before the task finished", lease.describe())
        return swapped

    def _never_skip(self, key: str, refusal: Refusal) -> None:
        """A call that is no duplicate meets another holder: never skip it.

        Such a call is a reserved one whose reservation lapsed, or a retry
        (which may carry no reservation: a newer copy held the key when it was
        published). Its callers may wait on it; it can neither run beside the
        holder nor be dropped as a duplicate. ``"skip"`` turns into a requeue;
        ``"requeue"`` and ``"raise"`` apply as configured.
        """
        request = self.task.request
        holder = refusal.holder
        holder_id = holder.task_id if holder else None
        if holder_id == request.id or self.options.on_conflict != "skip" or request.is_eager:
            return
        self._contended(key, refusal, "requeue")
        self._requeue(key, refusal, Decision("requeue"))

    def _retry_waits(self, key: str, lock: HandoverLock, refusal: Refusal) -> None:
        """A retry that came due while the attempt that published it still runs: wait.

        The attempt's lock becomes this message's reservation when it ends.
        This is a new attempt, not a redelivery, so it must run even if the
        earlier attempt ends in success (``retry(throw=False)``).
        """
        request = self.task.request
        holder = refusal.holder
        if (
            not (lock.reservation or header_of(request, CONTINUES_HEADER))
            or holder is None
            or holder.task_id != request.id
            or (request.delivery_info or {}).get("redelivered")
        ):
            return
        self._contended(key, refusal, "requeue")
        self._requeue(key, refusal, Decision("requeue", own=True), recheck=False)

    def store_failed(self, call: Call, exc: RedisError) -> Any:
        """As :class:`TaskGuard`, and the message's reservation does not outlive the call.

        A requeue carries the reservation on (see :func:`~.publish.apply_async`);
        a call that fails takes it back now, one that runs without the lock
        afterwards (:meth:`ran_unprotected`), when Redis is reachable again, or
        later calls would be folded into a call that is over.
        """
        if self.options.on_redis_error == "requeue":
            return super().store_failed(call, exc)
        outcome = UNPROTECTED
        try:
            outcome = super().store_failed(call, exc)
        finally:
            if outcome is not UNPROTECTED:
                self._drop_reservation(reservation_key(self.options.mode, call.key))
        return outcome

    def ran_unprotected(self, call: Call) -> None:
        """Take back the reservation of a call that ran without the lock."""
        self._drop_reservation(reservation_key(self.options.mode, call.key))

    def _drop_reservation(self, rkey: str) -> None:
        value = header_of(self.task.request, RESERVATION_HEADER)
        if not value:
            return
        try:
            if RELEASE(self.client, (rkey,), (value, "0")):
                logger.info(
                    "task %s[%s]: took back its reservation %s",
                    self.task.name,
                    self.task.request.id,
                    rkey,
                )
        except RedisError as exc:
            logger.warning(
                "task %s[%s]: could not take back its reservation %s (%s); it expires by itself",
                self.task.name,
                self.task.request.id,
                rkey,
                describe_error(exc),
            )

    def _lapsed(self, rkey: str) -> None:
        task, request = self.task, self.task.request
        if (request.delivery_info or {}).get("redelivered"):
            return  # a redelivered message's reservation was released on purpose
        if header_of(request, REQUEUES_HEADER):
            return  # reported when the lock first sent it back
        logger.warning(
            "task %s[%s]: its enqueue lock %s lapsed before it started (mode %s); "
            "it runs when its key is free, never dropped as a duplicate",
            task.name,
            request.id,
            rkey,
            self.options.mode,
        )
        signals.lock_lapsed.send(sender=task, task_id=request.id, key=rkey, mode=self.options.mode)


def release_revoked(task: Any, guard: TaskGuard, request: Any) -> bool:
    """Release the reservation of a revoked (or expired) message the worker discards.

    Returns:
        ``True`` if the reservation was still the message's and is now deleted.

    Raises:
        redis.exceptions.RedisError: If the lock store cannot be reached.
        LockKeyError: If the message's arguments cannot make a key.
    """
    value = header_of(request, RESERVATION_HEADER)
    if not value or not isinstance(guard, EnqueueGuard):
        return False
    key = guard.keys.key_for(request.args or (), request.kwargs or {})
    rkey = reservation_key(guard.options.mode, key)
    released = bool(RELEASE(guard.store.client, (rkey,), (value, "0")))
    if released:
        logger.info(
            "task %s[%s] was revoked before it ran; released its enqueue lock %s",
            task.name,
            request.id,
            rkey,
        )
    return released
