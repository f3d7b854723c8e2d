"""Enqueue locks: the lock windows that start in ``apply_async`` (see docs/modes.md).

``until_executing``, ``until_executed`` and ``until_and_while_executing``
reserve a call's key before its message is published. The reservation's value
is a :class:`~celery_redlock.core.holder.Holder` naming the new task id; the message
carries the same value in a header, so the worker can tell its own
reservation from a duplicate's. This module holds both halves:

* the publishing side, :func:`apply_async`: one ``RESERVE`` round trip, then
  publish; a duplicate gets the holder's ``AsyncResult`` or
  :class:`~celery_redlock.core.exceptions.DuplicateTask`; a failed publish releases
  the reservation; a task republishing itself (retry, requeue) keeps its own;
* the worker side, :class:`EnqueueGuard`: the start of a run drops the
  reservation (``until_executing``) or turns it into the execution lock in one
  Lua call (the other two), and reports a reservation that lapsed.

``while_executing`` never comes here: it costs no extra command.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, NoReturn, TypeVar

from celery.utils import uuid
from celery.utils.time import maybe_iso8601
from redis.exceptions import RedisError

from celery_redlock.core.exceptions import DuplicateTask, LockError
from celery_redlock.core.holder import Holder
from celery_redlock.core.lock import Lease, Lock
from celery_redlock.core.scripts import CANCEL_RESERVE, DEQUEUE, HANDOVER, RELEASE, RESERVE

from . import signals
from .guard import REQUEUES_HEADER, TaskGuard, current_lock, header_of, requeuing

__all__ = [
    "CANVAS_OPTIONS",
    "CONTINUES_HEADER",
    "RESERVATION_HEADER",
    "EnqueueGuard",
    "HandoverLock",
    "apply_async",
    "publish_delay",
    "release_revoked",
    "reservation_key",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Message header carrying the value of the message's reservation.
RESERVATION_HEADER = "x_redlock_reservation"
#: Message header set on a retry (and kept by its requeues): the message
#: continues a call that already ran, so the worker never drops it as a
#: duplicate, whatever reservation it does or does not carry.
CONTINUES_HEADER = "x_redlock_continues"

#: ``apply_async`` options that tie a call to a canvas. Such a call is never
#: folded into an existing copy: the copy would not carry its continuation.
CANVAS_OPTIONS = ("link", "link_error", "chain", "chord", "group_id")

#: How often a reservation whose RESERVE reply was lost is cancelled before giving up.
CANCEL_ATTEMPTS = 3

UNTIL_EXECUTING = "until_executing"
UNTIL_EXECUTED = "until_executed"

#: Publishes one message: ``(args, kwargs, task_id, options) -> AsyncResult``.
Publish = Callable[[Any, Any, str, "dict[str, Any]"], Any]

# Leases of until_executed attempts that published their own retry: when the
# attempt ends, its lock becomes the retry's reservation (value, monotonic
# deadline) instead of being released.
_handovers: weakref.WeakKeyDictionary[Lease, tuple[str, float]] = weakref.WeakKeyDictionary()


def reservation_key(mode: str, key: str) -> str:
    """Return the key a call's enqueue lock lives under.

    ``until_executed`` reserves the lock key itself: the reservation becomes
    the execution lock. The other modes reserve a sibling in the same hash
    slot, so a copy can be queued while another runs.
    """
    return key if mode == UNTIL_EXECUTED else f"{key}:queued"


def cancel_key(rkey: str) -> str:
    """Return the key that voids a reservation value whose ``RESERVE`` reply was lost.

    Same hash slot as ``rkey`` (it shares its hash tag); see ``scripts.CANCEL_RESERVE``.
    """
    return f"{rkey}:cancel"


def publish_delay(options: Mapping[str, Any], now: float | None = None) -> float:
    """Seconds until a message published with ``options`` may run (its countdown or eta).

    Read as Celery reads them: a falsy ``countdown`` (``0``) is ignored and
    ``eta`` applies. A naive ``eta`` is read both as UTC and as local time and
    the later reading wins: a reservation that lasts a little long is harmless,
    one that lapses before the task runs is not. A string ``eta`` is parsed as
    Celery parses it (``Z`` suffixes included, on every Python); one that does
    not parse counts as no delay, so the publish goes ahead and Celery itself
    reports the bad value.
    """
    now = time.time() if now is None else now
    countdown = options.get("countdown")
    if countdown:
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if isinstance(eta, str):
        try:
            eta = maybe_iso8601(eta)
        except (ValueError, OverflowError):
            return 0.0
    if not isinstance(eta, datetime):
        return 0.0
    if eta.tzinfo is not None:
        return max(0.0, eta.timestamp() - now)
    readings = (eta.replace(tzinfo=timezone.utc).timestamp(), eta.timestamp())
    return max(0.0, max(readings) - now)


def is_canvas(options: Mapping[str, Any]) -> bool:
    """``True`` if the call carries a chain, callbacks, or group or chord membership."""
    return any(options.get(name) for name in CANVAS_OPTIONS)


def _decode(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _with_reservation(options: dict[str, Any], value: str | None) -> dict[str, Any]:
    # headers= replaces the message's custom headers; a republished request
    # brings its old ones, whose reservation value is stale by now.
    headers = dict(options.get("headers") or {})
    headers.pop(RESERVATION_HEADER, None)
    if value is not None:
        headers[RESERVATION_HEADER] = value
    return {**options, "headers": headers}


# -- publishing side -----------------------------------------------------------------


def apply_async(
    guard: TaskGuard,
    publish: Publish,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    task_id: str | None,
    options: dict[str, Any],
) -> Any:
    """Reserve the call's key, then publish it; or return or refuse the copy holding it.

    Args:
        guard: The task's guard (its options, keys and lock store).
        publish: Publishes one message (Celery's own ``apply_async``).
        args: The call's positional arguments.
        kwargs: The call's keyword arguments.
        task_id: The id the caller chose, if any.
        options: The other ``apply_async`` options.

    Returns:
        The new task's ``AsyncResult``, or, under ``on_duplicate="return_existing"``,
        the one of the copy that holds the reservation.

    Raises:
        DuplicateTask: A copy holds the reservation and ``on_duplicate="raise"``,
            or the call belongs to a canvas.
        LockError: The lock store is unreachable and ``on_redis_error`` is not
            ``"run"``; nothing was published.
        LockKeyError: The arguments cannot make a key.
    """
    task = guard.task
    opts = guard.options
    if task.app.conf.task_always_eager:
        return publish(args, kwargs, task_id or uuid(), options)
    task_id = task_id or uuid()
    key = guard.keys.key_for(args or (), kwargs or {})
    rkey = reservation_key(opts.mode, key)
    request = task.request
    # A task republishing itself (self.retry, autoretry, the guard's requeue)
    # is the same task continuing: it keeps or renews its own reservation and
    # is never folded into another copy, or it would be lost.
    own = not request.called_directly and request.id == task_id
    # A requeue republishes a message that has not run; anything else a run
    # republishes under its own id is its retry. A retry says so in a header:
    # when a newer copy holds the key it goes out without a reservation, and
    # the worker must not take it for a duplicate of that copy.
    requeue = own and requeuing()
    if own and not requeue:
        options = {**options, "headers": {**(options.get("headers") or {}), CONTINUES_HEADER: 1}}
    lease = current_lock() if own else None
    handing = lease is not None and lease.name == rkey and not lease.released
    # The reservation the running message carries. A republish that cannot
    # take a new one keeps it in the new message: the next delivery then still
    # finds its reservation (a requeue while Redis is down) or learns that it
    # lapsed, instead of passing for a message that bypassed apply_async.
    kept = header_of(request, RESERVATION_HEADER) if own else None
    replace: Any = ""
    if handing:
        assert lease is not None
        replace = lease.token
    elif own:
        replace = kept or ""
    value = Holder.new(task_id).encode()
    ttl_ms = max(1, int((publish_delay(options) + opts.enqueue_ttl) * 1000))
    label = f"task {task.name}[{task_id}]"
    if handing:
        assert lease is not None
        return _publish_retry(
            guard, publish, (args, kwargs, task_id), options, lease, value, ttl_ms
        )
    try:
        reply = RESERVE(guard.store.client, (rkey, cancel_key(rkey)), (value, ttl_ms, replace))
    except RedisError as exc:
        # A RESERVE whose reply never came may have run, or may still run
        # after the client gave up: take it back, or the key would name a task
        # that was never published (or hide a running attempt's lock).
        _cancel(guard, rkey, value, ttl_ms, label)
        if own or opts.on_redis_error == "run":
            logger.warning(
                "%s: lock store unreachable for %s (%r); publishing WITHOUT an enqueue lock",
                label,
                rkey,
                exc,
            )
            return publish(args, kwargs, task_id, _with_reservation(options, kept))
        raise LockError(
            f"{label} was not published: lock store unreachable for {rkey}: {exc!r}",
            lock_name=rkey,
        ) from exc
    if reply != 1:
        pttl_ms, held = reply
        holder = Holder.parse(held)
        holder_id = holder.task_id if holder else None
        if own or holder_id == task_id:
            # The key already names this task (or another copy of a task
            # continuing itself): publish without taking it over.
            logger.debug("%s: %s is held by %s; republishing as is", label, rkey, holder_id)
            # A requeue carries its stale value on, so a copy whose reservation
            # lapsed is still known as one (and never skipped); a retry
            # carries CONTINUES_HEADER instead (and is never skipped either).
            return publish(
                args, kwargs, task_id, _with_reservation(options, kept if requeue else None)
            )
        holder_ttl = pttl_ms / 1000 if pttl_ms >= 0 else None
        canvas = is_canvas(options)
        if holder_id is None or opts.on_duplicate == "raise" or canvas:
            why = " (a canvas call is never folded into another copy)" if canvas else ""
            raise DuplicateTask(
                f"task {task.name} not published: task {holder_id or 'unknown'} holds "
                f"{rkey} for {holder_ttl}s more{why}",
                lock_name=rkey,
                task_id=holder_id,
                holder_ttl=holder_ttl,
            )
        logger.debug("task %s: a copy is enqueued as %s; returning it", task.name, holder_id)
        return task.AsyncResult(holder_id)
    try:
        return publish(args, kwargs, task_id, _with_reservation(options, value))
    except BaseException:
        _undo(guard, rkey, value, label)
        raise


def _publish_retry(
    guard: TaskGuard,
    publish: Publish,
    call: tuple[Any, Any, str],
    options: dict[str, Any],
    lease: Lease,
    value: str,
    ttl_ms: int,
) -> Any:
    """Publish the retry of a running until_executed attempt; its lock passes on at the end.

    The attempt keeps (and renews) its lock until it ends: code after
    ``self.retry()`` stays covered, and a retry that comes due meanwhile meets
    the lock of its own task id and waits. When the attempt ends, the lock
    becomes the retry's reservation in one compare-and-set (see
    :meth:`EnqueueGuard._release`). Nothing is stored before the publish, so a
    failed publish leaves the attempt's lock as it was.
    """
    args, kwargs, task_id = call
    label = f"task {guard.task.name}[{task_id}]"
    try:
        result = publish(args, kwargs, task_id, _with_reservation(options, value))
    except BaseException:
        logger.info("%s: publish failed; the running attempt keeps %s", label, lease.name)
        raise
    _handovers[lease] = (value, time.monotonic() + ttl_ms / 1000)
    return result


def _undo(guard: TaskGuard, rkey: str, value: str, label: str) -> None:
    """Take back a reservation nothing was published for (compare-and-delete, best effort)."""
    try:
        if RELEASE(guard.store.client, (rkey,), (value, "0")):
            logger.info("%s: publish failed; released its reservation %s", label, rkey)
    except RedisError as exc:
        logger.warning(
            "%s: publish failed and its reservation %s could not be released (%r); "
            "it expires by itself",
            label,
            rkey,
            exc,
        )


def _cancel(guard: TaskGuard, rkey: str, value: str, ttl_ms: int, label: str) -> None:
    """After a RESERVE that failed without a reply: undo it, now or whenever it runs.

    Redis runs commands from different connections in no set order, so a plain
    release sent now could run before the lost ``RESERVE``; ``CANCEL_RESERVE``
    leaves a cancel key that turns the late ``RESERVE`` into a no-op instead.
    It is idempotent, so it is tried up to :data:`CANCEL_ATTEMPTS` times: a
    server that was busy (the usual cause of a timeout) often answers the next.
    """
    for attempt in range(1, CANCEL_ATTEMPTS + 1):
        try:
            CANCEL_RESERVE.send(
                guard.store.client, (rkey, cancel_key(rkey)), (value, "", 1, ttl_ms)
            )
        except RedisError as exc:
            if attempt < CANCEL_ATTEMPTS:
                continue
            logger.warning(
                "%s: the reservation %s may have been taken and could not be cancelled "
                "(%r); if so, it expires within %ss",
                label,
                rkey,
                exc,
                ttl_ms / 1000,
            )
            return
        logger.info("%s: cancelled its reservation %s", label, rkey)
        return


# -- worker side ---------------------------------------------------------------------


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

    def run(self, args: Sequence[Any], kwargs: Mapping[str, Any], body: Callable[[], T]) -> T:
        """Run ``body`` in this mode's window, or resolve the conflict (see :class:`TaskGuard`)."""
        if self.options.mode != UNTIL_EXECUTING:
            return super().run(args, kwargs, body)
        request = self.task.request
        key = self.keys.key_for(args, kwargs)
        rkey = reservation_key(UNTIL_EXECUTING, key)
        value = header_of(request, RESERVATION_HEADER)
        try:
            reply = DEQUEUE(self.client, (rkey,), (value or "",))
        except RedisError as exc:
            return self._redis_failed(key, exc, body)
        if value and reply != 1:
            # This call was reserved; a newer copy's reservation (if any) is
            # not a reason to drop it, and this mode has no execution lock.
            self._lapsed(rkey)
        elif isinstance(reply, list) and header_of(request, CONTINUES_HEADER):
            # A retry that went out while a newer copy held the key: the call
            # it continues already left the queue, so it is no duplicate.
            logger.debug(
                "task %s[%s]: a retry; runs although %s is reserved by another copy",
                self.task.name,
                request.id,
                rkey,
            )
        elif isinstance(reply, list):
            pttl_ms, held = reply
            shim = super()._new_lock(rkey, request.id, f"task {self.task.name}[{request.id}]")
            shim.local.holder = (_decode(held), pttl_ms / 1000 if pttl_ms >= 0 else None)
            self._conflict(rkey, shim)
        return body()

    def _new_lock(self, key: str, task_id: str, label: str) -> Lock:
        request = self.task.request
        rkey = reservation_key(self.options.mode, key)
        return HandoverLock(
            self.client,
            key,
            reservation_key=rkey,
            reservation=header_of(request, RESERVATION_HEADER),
            on_lapsed=lambda: self._lapsed(rkey),
            **self._lock_options(task_id, label),
        )

    def _conflict(self, key: str, lock: Lock) -> NoReturn:
        try:
            if isinstance(lock, HandoverLock):
                if lock.lapsed or header_of(self.task.request, CONTINUES_HEADER):
                    self._never_skip(key, lock)
                self._retry_waits(key, lock)
            super()._conflict(key, lock)
        finally:
            # until_and_while_executing: this copy ends (skip, raise) or was
            # republished with a new reservation (requeue); either way the one
            # its message made must not keep duplicates out.
            if isinstance(lock, HandoverLock) and lock.reservation_key != key and lock.reservation:
                try:
                    RELEASE(self.client, (lock.reservation_key,), (lock.reservation, "0"))
                except RedisError as exc:
                    logger.warning("could not drop reservation %s: %r", lock.reservation_key, exc)

    def _release(self, lock: Lock, lease: Lease) -> None:
        handover = _handovers.pop(lease, None)
        if handover is None:
            return super()._release(lock, lease)
        value, deadline = handover
        # Flag first, as a release does: the watchdog stops renewing, and a
        # renewal racing with the swap does not report the lock lost.
        lease.released = True
        lease.on_lost = None
        ttl_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            swapped = RESERVE(self.client, (lease.name,), (value, ttl_ms, lease.token)) == 1
        except RedisError as exc:
            logger.warning(
                "%s: could not hand the lock to the retry (%r); it expires within %ss",
                lease.describe(),
                exc,
                lease.ttl,
            )
            return None
        if swapped:
            logger.debug("%s was handed to the task's next attempt", lease.describe())
        else:
            logger.error("%s was lost before the task finished", lease.describe())
        return None

    def _never_skip(self, key: str, lock: HandoverLock) -> None:
        """A call that is no duplicate meets another holder: never skip it.

        Such a call is a reserved one whose reservation lapsed, or a retry
        (which may carry no reservation: a newer copy held the key when it was
        published). Its callers may wait on it; it can neither run beside the
        holder nor be dropped as a duplicate. ``"skip"`` turns into a requeue;
        ``"requeue"`` and ``"raise"`` apply as configured.
        """
        request = self.task.request
        value, holder_ttl = lock.local.holder or (None, None)
        holder = Holder.parse(value)
        holder_id = holder.task_id if holder else None
        if holder_id == request.id or self.options.on_conflict != "skip" or request.is_eager:
            return
        self._contended(key, holder, "requeue")
        self._requeue(key, holder_id, holder_ttl)

    def _retry_waits(self, key: str, lock: HandoverLock) -> None:
        """A retry that came due while the attempt that published it still runs: wait.

        The attempt's lock becomes this message's reservation when it ends.
        This is a new attempt, not a redelivery, so it must run even if the
        earlier attempt ends in success (``retry(throw=False)``).
        """
        request = self.task.request
        value, holder_ttl = lock.local.holder or (None, None)
        holder = Holder.parse(value)
        if (
            not (lock.reservation or header_of(request, CONTINUES_HEADER))
            or holder is None
            or holder.task_id != request.id
            or (request.delivery_info or {}).get("redelivered")
        ):
            return
        self._contended(key, holder, "requeue")
        self._requeue(key, holder.task_id, holder_ttl, own=True, recheck=False)

    def _redis_failed(self, key: str, exc: RedisError, body: Callable[[], T]) -> T:
        """As :class:`TaskGuard`, and the message's reservation does not outlive the call.

        A requeue carries the reservation on (see :func:`apply_async`); a call
        that runs without the lock, or fails, takes it back afterwards when
        Redis is reachable again, or later calls would be folded into a call
        that is over.
        """
        if self.options.on_redis_error == "requeue":
            return super()._redis_failed(key, exc, body)
        try:
            return super()._redis_failed(key, exc, body)
        finally:
            self._drop_reservation(reservation_key(self.options.mode, key))

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
                "task %s[%s]: could not take back its reservation %s (%r); it expires by itself",
                self.task.name,
                self.task.request.id,
                rkey,
                exc,
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
