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
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from celery.exceptions import Ignore
from celery.utils import uuid
from redis.exceptions import RedisError

from celery_redlock.calls.decisions import Decision
from celery_redlock.calls.guarded import Call
from celery_redlock.calls.options import Mode
from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import ConfigurationError, LockError
from celery_redlock.core.holder import Refusal
from celery_redlock.core.lock import Lease, Lock
from celery_redlock.core.newest_scripts import CLAIM, STAMP, UNSTAMP

from .guard import TaskGuard
from .messages import GENERATION_HEADER, header_of
from .publish import Publish, Republish, publish_delay
from .result import SUPERSEDED

__all__ = ["NewestGuard", "NewestLock", "generation_key", "publish_newest"]

logger = logging.getLogger(__name__)


def generation_key(key: str) -> str:
    """The hash holding the newest generation of lock key ``key`` (same hash slot)."""
    return f"{key}:newest"


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _ms(seconds: float | None) -> int:
    return 0 if seconds is None else max(1, int(seconds * 1000))


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
            (the debounce sets the delay).
        LockError: The lock store is unreachable and ``on_redis_error`` is not
            ``"run"``; nothing was published.
        LockKeyError: The arguments cannot make a key.
    """
    task, opts = guard.task, guard.options
    task_id = task_id or uuid()
    if task.app.conf.task_always_eager:
        return publish(args, kwargs, task_id, options)
    hkey = generation_key(guard.keys.key_for(args or (), kwargs or {}))
    kind, _ = Republish.of(task, task_id, hkey)
    if kind is not Republish.NEW:
        return publish(args, kwargs, task_id, options)
    debounce = opts.mode is Mode.DEBOUNCE
    if debounce:
        _no_delay_given(task.name, options)
    label = f"task {task.name}[{task_id}]"
    extra_ms = _ms(publish_delay(options) + opts.enqueue_ttl)
    try:
        gen, epoch, delay_ms, replaced = STAMP(
            guard.store.client,
            (hkey,),
            (task_id, _ms(opts.debounce), _ms(opts.debounce_max_wait), extra_ms, _epoch()),
        )
    except RedisError as exc:
        _store_down(guard, label, hkey, exc)
        return publish(args, kwargs, task_id, options)
    stamp = f"{_text(epoch)}:{gen}"
    headers = {**(options.get("headers") or {}), GENERATION_HEADER: stamp}
    sent = {**options, "headers": headers}
    if debounce:
        sent["countdown"] = delay_ms / 1000
    if replaced and logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: generation %s of %s replaces %s", label, gen, hkey, _text(replaced))
    try:
        return publish(args, kwargs, task_id, sent)
    except BaseException:
        _unstamp(guard, hkey, (gen, task_id, _text(replaced)), label)
        raise


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


def _epoch() -> str:
    return secrets.token_hex(8)


def _unstamp(guard: TaskGuard, hkey: str, stamp: tuple[int, str, str], label: str) -> None:
    """Give back the generation of a call the broker refused, so the one it replaced still runs."""
    gen, task_id, replaced = stamp
    try:
        UNSTAMP(guard.store.client, (hkey,), (gen, task_id, replaced))
    except RedisError as exc:
        logger.warning(
            "%s: publish failed and its generation of %s could not be given back (%s); "
            "the copy it replaced retires as superseded",
            label,
            hkey,
            describe_error(exc),
        )


def parse_stamp(value: Any) -> tuple[str, str] | None:
    """``(epoch, generation)`` from a message's generation header, or ``None``."""
    if not isinstance(value, str) or ":" not in value:
        return None
    epoch, _, gen = value.rpartition(":")
    return (epoch, gen) if gen.isdigit() else None


class NewestLock(Lock):
    """The execution lock of a copy that runs only if it still carries the newest generation.

    After a refused :meth:`acquire`, :attr:`superseded_by` names the copy that
    replaced this one, or :attr:`recovered` says that the generation was lost
    and this copy now stands as the newest; otherwise a copy runs
    (:attr:`refusal`).

    Args:
        redis: The lock store's client.
        name: The lock key.
        stamp: ``(epoch, generation)`` the message carries, or ``None``.
        task_id: The message's task id.
        keep_ms: How long the generation hash lasts after this call.
        **kwargs: :class:`~celery_redlock.core.lock.Lock`'s options.
    """

    def __init__(
        self,
        redis: Any,
        name: str,
        *,
        stamp: tuple[str, str] | None,
        task_id: str,
        keep_ms: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(redis, name, **kwargs)
        self.stamp = stamp
        self.task_id = task_id
        self.keep_ms = keep_ms
        #: The task id of the copy that replaced this one, after a refusal.
        self.superseded_by: str | None = None
        #: The generation hash was gone; this copy registered itself as the newest.
        self.recovered = False

    def do_acquire(self, token: bytes) -> bool:
        """Make one ``CLAIM``; on success store the new lease for this thread."""
        sent_at = self._clock()
        epoch, gen = self.stamp or ("", "")
        reply = CLAIM(
            self.redis,
            (self.name, self.fence_key, generation_key(self.name)),
            (token, self._ttl_ms, self._fence_retention_ms, gen, epoch, self.task_id, self.keep_ms),
        )
        status = int(reply[0])
        self.local.holder = None
        if status == 1:
            self.local.lease = self._new_lease(Lease, self.redis, token, int(reply[1]), sent_at)
            return True
        if status == 0:
            self.local.holder = (_text(reply[2]), reply[1] / 1000 if reply[1] >= 0 else None)
        elif status == 2:
            self.superseded_by = _text(reply[1])
        else:
            self.recovered = True
        return False


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
            keep_ms=_ms(self.options.enqueue_ttl + (self.options.debounce or 0)),
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
        if not task.ignore_result:
            try:
                task.update_state(state=SUPERSEDED, meta={"by": by, "key": call.key})
            except Exception:  # recording is a courtesy; the copy still retires
                logger.warning("task %s[%s]: could not record SUPERSEDED", task.name, request.id)
        raise Ignore()
