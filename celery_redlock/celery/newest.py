"""The windows that keep the newest call: ``debounce`` and ``keep="latest"``, both sides.

A published message cannot be taken back, so a newer call does not remove an
older one: it draws the next generation of the key (one ``STAMP`` call in
``apply_async``) and its message carries it in a header. When a message
reaches a worker, :class:`NewestLock` runs it only if its generation is still
the newest, and takes the execution lock in the same ``CLAIM`` call; an older
message records ``SUPERSEDED`` naming the copy that replaced it and ends
(:class:`NewestGuard`). ``debounce`` also delays each message until the burst
has been quiet for ``lock_debounce`` seconds (at most ``lock_debounce_max_wait``
after its first call). See docs/modes.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore
from celery.utils import uuid
from redis.exceptions import RedisError

from celery_redlock.calls.decisions import Decision
from celery_redlock.calls.guarded import Call
from celery_redlock.calls.options import Mode
from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import ConfigurationError, LockError
from celery_redlock.core.holder import Refusal
from celery_redlock.core.lock import Lock
from celery_redlock.core.newest import (
    NewestLock,
    Stamp,
    generation_key,
    parse_stamp,
    script_ms,
    stamp,
    unstamp,
)

from .guard import TaskGuard
from .messages import GENERATION_HEADER, header_of
from .publish import Publish, Republish, publish_delay
from .result import SUPERSEDED

__all__ = ["NewestGuard", "publish_newest"]

logger = logging.getLogger(__name__)


def publish_newest(
    guard: TaskGuard,
    publish: Publish,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    task_id: str | None,
    options: dict[str, Any],
) -> Any:
    """Stamp the call with its key's next generation, then publish it (one ``STAMP`` call).

    A task republishing itself (a retry, the guard's requeue) keeps the
    generation its message carries: it is no newer call.

    Returns:
        The new call's ``AsyncResult``; older copies of the key retire when they
        reach a worker and their results follow this one.

    Raises:
        ConfigurationError: ``countdown`` or ``eta`` given to a debounced call
            (the debounce sets the delay), or the call is a member of a group
            or chord (naming ``group_id`` or ``chord``).
        LockError: The lock store is unreachable and ``on_redis_error`` is not
            ``"run"``; nothing was published.
        LockKeyError: The arguments cannot make a key.
    """
    task, opts = guard.task, guard.options
    task_id = task_id or uuid()
    if task.app.conf.task_always_eager:
        return publish(args, kwargs, task_id, options)
    key = guard.keys.key_for(args or (), kwargs or {})
    kind, _ = Republish.of(task, task_id, generation_key(key))
    if kind is not Republish.NEW:
        return publish(args, kwargs, task_id, options)
    _check_call(task.name, opts.mode, options)
    debounce = opts.mode is Mode.DEBOUNCE
    label = f"task {task.name}[{task_id}]"
    try:
        drawn = stamp(
            guard.store.client,
            key,
            task_id,
            debounce=opts.debounce,
            max_wait=opts.debounce_max_wait,
            keep_for=publish_delay(options) + opts.enqueue_ttl,
        )
    except RedisError as exc:
        _store_down(guard, label, generation_key(key), exc)
        return publish(args, kwargs, task_id, options)
    headers = {**(options.get("headers") or {}), GENERATION_HEADER: drawn.encode()}
    sent = {**options, "headers": headers}
    if debounce:
        sent["countdown"] = drawn.delay
    if drawn.replaced:
        logger.debug("%s: %s of %s replaces %s", label, drawn.encode(), key, drawn.replaced)
    try:
        return publish(args, kwargs, task_id, sent)
    except BaseException:
        _unstamp(guard, key, task_id, drawn, label)
        raise


def _check_call(name: str, mode: Mode, options: Mapping[str, Any]) -> None:
    """Refuse a group or chord member, and a delay given to a debounced call.

    A superseded member would never finish its group or chord; a debounce sets
    its own delay.
    """
    which = next((option for option in ("chord", "group_id") if options.get(option)), None)
    if which is not None:
        raise ConfigurationError(
            which,
            options[which],
            f"{name} keeps only the newest call ({mode.value}): a superseded member never "
            "finishes, so its group's result and its chord would wait for ever; call it "
            "outside a group or chord",
        )
    if mode is Mode.DEBOUNCE:
        _no_delay_given(name, options)


def _no_delay_given(name: str, options: Mapping[str, Any]) -> None:
    if options.get("countdown") or options.get("eta"):
        which = "countdown" if options.get("countdown") else "eta"
        raise ConfigurationError(
            which, options[which], f"{name} is debounced: lock_debounce sets its delay"
        )


def _store_down(guard: TaskGuard, label: str, hkey: str, exc: RedisError) -> None:
    """Refuse the call, or (``on_redis_error="run"``) let it go out without a generation."""
    if guard.options.on_redis_error != "run":
        raise LockError(
            f"{label} was not published: lock store unreachable for {hkey}: {describe_error(exc)}",
            lock_name=hkey,
        ) from exc
    logger.warning(
        "%s: lock store unreachable for %s (%s); publishing WITHOUT a generation",
        label,
        hkey,
        describe_error(exc),
    )


def _unstamp(guard: TaskGuard, key: str, task_id: str, drawn: Stamp, label: str) -> None:
    """Give back the generation of a call the broker refused, so the one it replaced still runs."""
    try:
        unstamp(guard.store.client, key, task_id, drawn)
    except RedisError as exc:
        logger.warning(
            "%s: publish failed and its generation of %s could not be given back (%s); "
            "the copy it replaced retires as superseded",
            label,
            key,
            describe_error(exc),
        )


class NewestGuard(TaskGuard):
    """The guard of a task in ``debounce`` or ``keep="latest"``: only the newest copy runs.

    A superseded copy records ``SUPERSEDED`` (meta ``by``: the replacing task
    id, ``key``) and ends without running; the newest copy meeting a running
    one follows ``lock_on_conflict`` (default ``"requeue"``: it waits).
    """

    def new_lock(self, call: Call) -> Lock:
        """The execution lock, taken only by the newest generation of the key."""
        request = self.task.request
        return NewestLock(
            self.store.client,
            call.key,
            stamp=parse_stamp(header_of(request, GENERATION_HEADER)),
            task_id=request.id,
            keep_ms=script_ms(self.options.enqueue_ttl + (self.options.debounce or 0)),
            **self._lock_options(call),
        )

    def refused(self, call: Call, lock: Any) -> NoReturn:
        """Retire a superseded copy; let a recovered one wait a quiet time; else ``on_conflict``."""
        if lock.superseded_by is not None:
            self._superseded(call, lock.superseded_by)
        if lock.recovered:
            delay = self.options.debounce or self.options.requeue_delay
            logger.warning(
                "%s: the generation of %s was lost (lock store restarted or expired); "
                "this copy stands as the newest and waits %ss for a newer one",
                call.label,
                call.key,
                delay,
            )
            self._requeue(call.key, Refusal(), Decision("requeue"), delay=delay)
        self._conflict(call.key, lock.refusal)

    def _superseded(self, call: Call, by: str) -> NoReturn:
        task, request = self.task, self.task.request
        logger.info("%s: superseded by task %s; not running", call.label, by)
        if not task.ignore_result and not isinstance(task.backend, DisabledBackend):
            try:
                task.update_state(state=SUPERSEDED, meta={"by": by, "key": call.key})
            except Exception:  # recording is a courtesy; the copy still retires
                logger.warning("task %s[%s]: could not record SUPERSEDED", task.name, request.id)
        raise Ignore()
