"""The publish side of the enqueue windows: reserve a call's key, then publish it.

``until_executing``, ``until_executed`` and ``until_and_while_executing``
reserve a call's key before its message is published (see docs/modes.md). The
reservation's value is a :class:`~celery_redlock.core.holder.Holder` naming the
new task id; the message carries the same value in a header, so the worker
(:mod:`celery_redlock.celery.window`) can tell its own reservation from a
duplicate's. :func:`apply_async` makes one ``RESERVE`` round trip, then
publishes; a duplicate gets the holder's ``AsyncResult`` or
:class:`~celery_redlock.core.exceptions.DuplicateTask`; a failed publish
releases the reservation; a task republishing itself keeps its own.

``while_executing`` never comes here: it costs no extra command.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from celery.utils import uuid
from celery.utils.time import maybe_iso8601
from redis.exceptions import RedisError

from celery_redlock.calls.context import current_lock
from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import DuplicateTask, LockError
from celery_redlock.core.holder import Holder
from celery_redlock.core.lock import Lease
from celery_redlock.core.newest import script_ms
from celery_redlock.core.scripts import RELEASE
from celery_redlock.core.window_scripts import CANCEL_RESERVE, RESERVE

from .guard import TaskGuard, requeuing
from .messages import CONTINUES_HEADER, RESERVATION_HEADER, header_of
from .window import hand_over_at_end, reservation_key

__all__ = [
    "CANVAS_OPTIONS",
    "Republish",
    "apply_async",
    "cancel_key",
    "is_canvas",
    "publish_delay",
]

logger = logging.getLogger(__name__)

#: ``apply_async`` options that tie a call to a canvas. Such a call is never
#: folded into an existing copy: the copy would not carry its continuation.
CANVAS_OPTIONS = ("link", "link_error", "chain", "chord", "group_id")

#: How often a reservation whose RESERVE reply was lost is cancelled before giving up.
CANCEL_ATTEMPTS = 3

#: Publishes one message: ``(args, kwargs, task_id, options) -> AsyncResult``.
Publish = Callable[[Any, Any, str, "dict[str, Any]"], Any]


class Republish(enum.Enum):
    """What a publish is, seen from the task that may be running it.

    A task republishing itself (``self.retry``, autoretry, the guard's requeue)
    is the same task continuing: it keeps or renews its own reservation and is
    never folded into another copy, or it would be lost.
    """

    #: A call of its own: anything but the running task republishing itself.
    NEW = "new"
    #: The running task's retry: a call that ran, continued.
    RETRY = "retry"
    #: The guard sending back a call that has not run (its key was held).
    REQUEUE = "requeue"
    #: The retry of an ``until_executed`` attempt that holds its key: the
    #: attempt's lock becomes the retry's reservation when the attempt ends.
    HANDOVER = "handover"

    @classmethod
    def of(cls, task: Any, task_id: str, rkey: str) -> tuple[Republish, Lease | None]:
        """Classify publishing ``task_id`` now; with the running attempt's lease for a handover."""
        request = task.request
        if request.called_directly or request.id != task_id:
            return cls.NEW, None
        if requeuing():
            return cls.REQUEUE, None
        lease = current_lock()
        if lease is not None and lease.name == rkey and not lease.released:
            return cls.HANDOVER, lease
        return cls.RETRY, None


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


def _with_reservation(options: dict[str, Any], value: str | None) -> dict[str, Any]:
    # headers= replaces the message's custom headers; a republished request
    # brings its old ones, whose reservation value is stale by now.
    headers = dict(options.get("headers") or {})
    headers.pop(RESERVATION_HEADER, None)
    if value is not None:
        headers[RESERVATION_HEADER] = value
    return {**options, "headers": headers}


def _reservation_ms(guard: TaskGuard, options: Mapping[str, Any]) -> int:
    """How long a new call's reservation lasts, in ms.

    ``until_expired``: its period, from acceptance; a retry or requeue of the
    accepted call neither renews it nor meets it. Other windows: the call's
    delay plus ``enqueue_ttl``.
    """
    if guard.options.period is not None:
        return script_ms(guard.options.period)
    return script_ms(publish_delay(options) + guard.options.enqueue_ttl)


# long because: its docstring lists every outcome; the body is one path with early exits
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
        The new task's ``AsyncResult``, or the holding copy's (``return_existing``).

    Raises:
        DuplicateTask: A copy holds the reservation and ``on_duplicate="raise"``,
            or the call belongs to a canvas.
        LockError: The lock store is unreachable and ``on_redis_error`` is not
            ``"run"``; nothing was published.
        LockKeyError: The arguments cannot make a key.
    """
    task = guard.task
    if task.app.conf.task_always_eager:
        return publish(args, kwargs, task_id or uuid(), options)
    task_id = task_id or uuid()
    rkey = reservation_key(guard.options.mode, guard.keys.key_for(args or (), kwargs or {}))
    kind, lease = Republish.of(task, task_id, rkey)
    value = Holder.new(task_id).encode()
    ttl_ms = _reservation_ms(guard, options)
    call = (args, kwargs, task_id)
    if guard.options.period is not None and kind is not Republish.NEW:
        return publish(args, kwargs, task_id, options)  # until_expired: see _reservation_ms
    if lease is not None:
        return _publish_retry(guard, publish, call, options, lease, value, ttl_ms)
    if kind is Republish.RETRY:
        # When a newer copy holds the key the retry goes out without a
        # reservation: the header tells the worker it is no duplicate of it.
        options = {**options, "headers": {**(options.get("headers") or {}), CONTINUES_HEADER: 1}}
    # The reservation the running message carries. A republish that cannot
    # take a new one keeps it in the new message: the next delivery then still
    # finds its reservation (a requeue while Redis is down) or learns that it
    # lapsed, instead of passing for a message that bypassed apply_async.
    kept = header_of(task.request, RESERVATION_HEADER) if kind is not Republish.NEW else None
    label = f"task {task.name}[{task_id}]"
    try:
        reply = RESERVE(guard.store.client, (rkey, cancel_key(rkey)), (value, ttl_ms, kept or ""))
    except RedisError as exc:
        return _store_down(guard, publish, call, options, (rkey, value, ttl_ms), kind, kept, exc)
    if reply != 1:
        return _held(guard, publish, call, options, rkey, reply, kind, kept)
    try:
        return publish(args, kwargs, task_id, _with_reservation(options, value))
    except BaseException:
        _undo(guard, rkey, value, label)
        raise


def _store_down(
    guard: TaskGuard,
    publish: Publish,
    call: tuple[Any, Any, str],
    options: dict[str, Any],
    reservation: tuple[str, str, int],
    kind: Republish,
    kept: str | None,
    exc: RedisError,
) -> Any:
    """Publish without a reservation (a republish, or ``on_redis_error="run"``), or refuse."""
    args, kwargs, task_id = call
    rkey, value, ttl_ms = reservation
    label = f"task {guard.task.name}[{task_id}]"
    # A RESERVE whose reply never came may have run, or may still run after
    # the client gave up: take it back, or the key would name a task that was
    # never published (or hide a running attempt's lock).
    _cancel(guard, rkey, value, ttl_ms, label)
    if kind is Republish.NEW and guard.options.on_redis_error != "run":
        raise LockError(
            f"{label} was not published: lock store unreachable for {rkey}: {describe_error(exc)}",
            lock_name=rkey,
        ) from exc
    logger.warning(
        "%s: lock store unreachable for %s (%s); publishing WITHOUT an enqueue lock",
        label,
        rkey,
        describe_error(exc),
    )
    return publish(args, kwargs, task_id, _with_reservation(options, kept))


def _held(
    guard: TaskGuard,
    publish: Publish,
    call: tuple[Any, Any, str],
    options: dict[str, Any],
    rkey: str,
    reply: Any,
    kind: Republish,
    kept: str | None,
) -> Any:
    """The key is reserved already: republish as is, return the holder's result, or refuse."""
    args, kwargs, task_id = call
    task = guard.task
    pttl_ms, held = reply
    holder = Holder.parse(held)
    holder_id = holder.task_id if holder else None
    if kind is not Republish.NEW or holder_id == task_id:
        # The key already names this task (or another copy of a task
        # continuing itself): publish without taking it over. A requeue
        # carries its stale value on, so a copy whose reservation lapsed is
        # still known as one (and never skipped); a retry carries
        # CONTINUES_HEADER instead (and is never skipped either).
        logger.debug(
            "task %s[%s]: %s is held by %s; republishing as is", task.name, task_id, rkey, holder_id
        )
        carried = kept if kind is Republish.REQUEUE else None
        return publish(args, kwargs, task_id, _with_reservation(options, carried))
    holder_ttl = pttl_ms / 1000 if pttl_ms >= 0 else None
    canvas = is_canvas(options)
    if holder_id is None or guard.options.on_duplicate == "raise" or canvas:
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
    :meth:`~celery_redlock.celery.window.EnqueueGuard.release`). Nothing is
    stored before the publish, so a failed publish leaves the attempt's lock as it was.
    """
    args, kwargs, task_id = call
    label = f"task {guard.task.name}[{task_id}]"
    try:
        result = publish(args, kwargs, task_id, _with_reservation(options, value))
    except BaseException:
        logger.info("%s: publish failed; the running attempt keeps %s", label, lease.name)
        raise
    hand_over_at_end(lease, value, ttl_ms)
    return result


def _undo(guard: TaskGuard, rkey: str, value: str, label: str) -> None:
    """Take back a reservation nothing was published for (compare-and-delete, best effort)."""
    try:
        if RELEASE(guard.store.client, (rkey,), (value, "0")):
            logger.info("%s: publish failed; released its reservation %s", label, rkey)
    except RedisError as exc:
        logger.warning(
            "%s: publish failed and its reservation %s could not be released (%s); "
            "it expires by itself",
            label,
            rkey,
            describe_error(exc),
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
                "(%s); if so, it expires within %ss",
                label,
                rkey,
                describe_error(exc),
                ttl_ms / 1000,
            )
            return
        logger.info("%s: cancelled its reservation %s", label, rkey)
        return
