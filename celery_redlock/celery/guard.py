"""The one place that runs a task under its lock: acquire, run, release, or resolve a conflict.

:class:`TaskGuard` is shared by :class:`~celery_redlock.SingletonTask` and the
per-queue hooks. It is built once per task and process; the state of each run
(the lock, its lease) lives in local variables and a context variable, never
on the task instance, which thread and gevent pools share between runs.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, NoReturn

from celery.exceptions import Ignore, Reject
from redis.exceptions import RedisError

from celery_redlock.calls.context import current_lock
from celery_redlock.calls.decisions import (
    Decision,
    decide,
    fair_countdown,
    gave_up,
    log_rate_limited,
    log_store_failure,
    not_acquired,
    rate_action,
    rate_countdown,
    rate_keys,
    rate_limited,
    requeue_countdown,
    requeues_charged,
)
from celery_redlock.calls.guarded import UNPROTECTED, Call, Guard, run_guarded
from celery_redlock.calls.options import LockOptions
from celery_redlock.core.admission import AdmissionLock
from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import LockError, LockNotAcquired
from celery_redlock.core.fences import is_cluster
from celery_redlock.core.holder import Holder, Refusal, queue_of
from celery_redlock.core.keys import KeyBuilder
from celery_redlock.core.line import leave_line
from celery_redlock.core.lock import Lease, Lock
from celery_redlock.core.rate import RateLimiter, RateVerdict
from celery_redlock.core.store import LockStore

from . import events
from .messages import QUEUE_HEADER, REQUEUES_HEADER, SELF_HEADER, header_of, requeues_of
from .queueing import in_line, line_header, place_for, seen_in_line, waited
from .reaper import app_holder_margin
from .result import already_done
from .skipping import Skipped, ends_quietly, hooks_see_success, skip

__all__ = [
    "TaskGuard",
    "current_lock",
    "requeuing",
]

logger = logging.getLogger(__name__)


# Set while the guard republishes a call it did not run (a requeue), so the
# enqueue side can tell it from a retry, which republishes a call that ran.
_requeuing: ContextVar[bool] = ContextVar("celery_redlock_requeuing", default=False)


def requeuing() -> bool:
    """``True`` while the guard is publishing a requeue of the current call."""
    return _requeuing.get()


class TaskCall(Call):
    """A task's call: also whether it is a copy that met its own task's lock (read once)."""

    __slots__ = ("met_itself", "started")

    met_itself: bool
    #: ``time.monotonic()`` when the run began: the start of the lock wait the metrics measure.
    started: float


class TaskGuard(Guard[Any]):
    """Runs the calls of one task under its lock.

    Args:
        task: The task (a bound ``celery.Task`` instance).
        options: Its resolved lock options.
        store: The lock store (one Redis, Redlock masters, Cluster or Sentinel).
        queue: The locked queue this guard serves, if any. The lock's value
            records it; without it, the queue the delivery's route names.
    """

    kind = "task"
    log = logger

    def __init__(
        self, task: Any, options: LockOptions, store: LockStore, queue: str | None = None
    ) -> None:
        self.task = task
        self.options = options
        self.store = store
        self.queue = queue
        self.keys = KeyBuilder(task.name, task.run, options.key, options.key_prefix)
        self.rate_keys = rate_keys(task.name, task.run, options)
        self._limiter: RateLimiter | None = None
        # The first plain Lock built, whose options later calls' locks copy,
        # and the fence counter every key of this task draws from (None on
        # Cluster, where it depends on the key's slot).
        self._template: Lock | None = None
        self._fence_key: str | None = None
        self._in_line = in_line(options)
        self._hooks_see_success = hooks_see_success(task)
        # What a long TTL leaves to the reaper (see reaper.holder_margin).
        self._reap_margin = app_holder_margin(task.app.conf, options.ttl)

    def run(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        body: Callable[[], Any],
        request: Any = None,
    ) -> Any:
        """Run ``body`` while holding the lock of this call, or resolve the conflict.

        ``request``: the task's running request, when the caller has read it
        already (``task.request`` is a slow property); ``None`` reads it.

        Returns:
            The body's result; for a skipped call whose run can end quietly
            (:func:`~celery_redlock.celery.skipping.ends_quietly`), a text
            saying why it was skipped, which Celery neither stores nor passes on.

        Raises:
            celery.exceptions.Ignore: When the call is requeued, or skipped and
                cannot end quietly.
            LockNotAcquired: Under ``on_conflict="raise"``, or when requeues run out.
            LockKeyError: When the arguments cannot make a key.
        """
        try:
            return run_guarded(self, self._call(args, kwargs, request), body)
        except Skipped as skipped:
            if ends_quietly(self.task.request, self._hooks_see_success):
                return str(skipped)
            raise skipped.with_traceback(None) from None
        except Ignore as ignored:
            # Celery copies every frame of an Ignore's traceback (with each code
            # object's position table) into an ExceptionInfo, twice: starting
            # the traceback here leaves out the frames of the conflict handling,
            # about a tenth of what a skipped or requeued duplicate costs.
            raise ignored.with_traceback(None) from None

    def _call(self, args: Sequence[Any], kwargs: Mapping[str, Any], request: Any = None) -> Call:
        """Describe the running request's call: its key, and the holder its lock will name."""
        started = time.monotonic()
        task = self.task
        if request is None:
            request = task.request
        task_id = request.id
        value = Holder.new_value(
            task_id,
            request.hostname,
            ttl=self.options.ttl,
            queue=self.queue or queue_of(request.delivery_info),
        )
        call = TaskCall(
            self.keys.key_for(args, kwargs), value, f"task {task.name}[{task_id}]", task_id
        )
        call.started = started
        call.met_itself = self._met_itself(request)
        if self._in_line:
            call.place = place_for(request, self.options)
        if self.rate_keys is not None:
            call.rate_key = self.rate_keys.key_for(args, kwargs)
        return call

    def rate_limiter(self, call: Call) -> RateLimiter:
        """The task's limiter, on the lock store's client (built on first use)."""
        if self._limiter is None:
            assert self.options.rate is not None  # only calls with a rate key get here
            self._limiter = RateLimiter(self.store.client, self.options.rate)
        return self._limiter

    def rate_limited(self, call: Call, verdict: RateVerdict) -> NoReturn:
        """Requeue until a slot frees (not counted as a retry or requeue), skip, or raise."""
        assert call.rate_key is not None and self.options.rate is not None
        request = self.task.request
        action = rate_action(self.options.on_conflict, can_requeue=not request.is_eager)
        log_rate_limited(call, self.options.rate, verdict, action, logger)
        if action == "requeue":
            delay = rate_countdown(self.options, verdict, random.random())
            self._requeue(call.rate_key, Refusal(), Decision("requeue"), delay=delay)
        if action == "skip":
            why = f"skipped: rate {self.options.rate} of {call.rate_key} reached"
            skip(self.task, call.rate_key, None, why, reason="rate")
        raise rate_limited(call.label, call.rate_key, self.options.rate, verdict)

    def new_lock(self, call: Call) -> AdmissionLock:
        """Build the lock one run takes: a lock, or a semaphore permit under ``lock_limit``.

        Enqueue modes take theirs differently (and refuse a limit).

        Raises:
            redis.exceptions.RedisError: When the store's client cannot be built
                (a Redis Cluster connects to learn its slots).
        """
        template = self._template
        if template is not None:
            return template.renamed(
                call.key, on_lost=self._on_lost(call), label=call.label, fence_key=self._fence_key
            )
        lock = self.store.lock(call.key, limit=self.options.limit, **self._lock_options(call))
        if type(lock) is Lock:  # the same options for every call: later calls copy them
            self._template = lock
            # Every key of a task has one prefix, so one counter (see fence_key_for).
            self._fence_key = None if is_cluster(lock.redis) else lock.fence_key
        return lock

    def _lock_options(self, call: Call) -> dict[str, Any]:
        """The options of every run's lock, whichever class takes it."""
        return {
            "timeout": self.options.ttl,
            "blocking": False,
            "thread_local": False,
            "auto_renew": True,
            "on_lost": self._on_lost(call),
            "label": call.label,
        }

    def _on_lost(self, call: Call) -> Callable[[Lease], None]:
        # Only the id: the lease outlives the run in the watchdog's heap, and
        # the request would keep the call's arguments alive with it.
        task_id = call.call_id
        return lambda lease: self._report_lost(lease, task_id)

    def acquired(self, call: Call, lease: Lease) -> None:
        """Log and count the acquisition; send ``lock_acquired`` to its receivers."""
        if self._reap_margin:
            lease.leave_to_reaper(self._reap_margin)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s acquired", lease.describe())
        events.send_acquired(
            self.task,
            call.call_id,
            call.key,
            lease.fence,
            self.options.ttl,
            None if call.place is None else waited(call.place),
            getattr(call, "started", None),
        )

    def starting(self, call: Call, lease: Lease) -> None:
        """Drop a requeued copy of a call whose earlier delivery finished meanwhile."""
        if getattr(call, "met_itself", False) and already_done(self.task, self.task.request.id):
            logger.info("%s: an earlier delivery already ran it; dropping", call.label)
            raise Ignore()

    def release(self, call: Call, lock: Any, lease: Lease) -> bool:
        """Release, then count it and send ``lock_released`` (was the lock still this run's).

        Runs in the finally of the task body: before Celery stores the result,
        so a caller that sees the result can enqueue the same call at once.
        """
        owned = super().release(call, lock, lease)
        events.send_released(self.task, call.call_id, lease.name, lease.fence, owned)
        return owned

    def _report_lost(self, lease: Lease, task_id: str | None) -> None:
        # Runs on the watchdog thread; the lease has already logged the loss.
        events.send_lost(self.task, task_id, lease.name, lease.fence, lease.loss_reason)

    def refused(self, call: Call, lock: Any) -> NoReturn:
        """Skip, requeue or raise as ``on_conflict`` says; wait for an own earlier delivery."""
        self._conflict(call.key, lock.refusal, lock if call.place is not None else None)

    def _conflict(self, key: str, refusal: Refusal, line: Any = None) -> NoReturn:
        request = self.task.request
        decision = decide(
            refusal,
            request.id,
            self.options.on_conflict,
            requeues=requeues_charged(self.options, requeues_of(request), refusal),
            max_requeues=self.options.max_requeues,
            # An eager call cannot be requeued: the requeue would run it again
            # at once, inside this call (see _requeue).
            can_requeue=not request.is_eager or refusal.holder_id == request.id,
        )
        self._contended(key, refusal, decision.action)
        if decision.gave_up:
            if line is not None:
                self._leave_line(line, key)
            raise gave_up(self._label(), key, self.options.max_requeues, refusal)
        if decision.action == "requeue":
            # A redelivery of this very task (decision.own): its first delivery
            # holds the lock, alive or dead. Skipping could lose the task for
            # good (if the first delivery died) and running would run it twice.
            self._requeue(key, refusal, decision)
        if decision.action == "skip":
            skip(self.task, key, refusal.holder, f"skipped: {refusal.describe()} holds lock {key}")
        raise not_acquired(self._label(), key, refusal, "task")

    def _leave_line(self, lock: Any, key: str) -> None:
        try:  # best effort: an entry not renewed lapses anyway
            leave_line(lock.redis, key, str(self.task.request.id))
        except RedisError as exc:
            logger.warning("%s: could not leave the line of %s (%s)", self._label(), key, exc)

    def _label(self) -> str:
        return f"task {self.task.name}[{self.task.request.id}]"

    def _contended(self, key: str, refusal: Refusal, action: str) -> None:
        task, request = self.task, self.task.request
        attempt = requeues_of(request)
        if logger.isEnabledFor(logging.INFO):  # describe() formats; a storm skips thousands
            logger.info(
                "task %s[%s]: %s holds lock %s; %s",
                task.name,
                request.id,
                refusal.describe(),
                key,
                action,
            )
        events.send_contended(
            task,
            request.id,
            key,
            refusal.holder.task_id if refusal.holder else None,
            action,
            attempt,
            refusal.waiting if refusal.rank is not None else None,
        )

    def _requeue(
        self,
        key: str,
        refusal: Refusal,
        decision: Decision,
        recheck: bool = True,
        delay: float | None = None,
    ) -> NoReturn:
        """Publish this call again with a backoff delay, then end this run with ``Ignore``.

        Under ``acks_late`` the publish happens before Celery acknowledges the
        message, so a crash in between leaves a duplicate, never a loss.

        Raises:
            LockNotAcquired: For an eager call (a requeue would run it again at
                once, inside this call). ``max_requeues`` is not checked
                here: :func:`decide` did. With ``recheck`` a copy meeting its
                own lock (``decision.own``) is marked to drop itself if the
                holder turns out to have finished the task. A ``delay`` given
                (a rate limit's exact wait) is used as it is, and the requeue
                is not counted. A call in line (``refusal.rank``) carries its
                place, and its countdown is :func:`fair_countdown`'s.
        """
        request = self.task.request
        attempt = requeues_of(request) + (1 if delay is None else 0)
        if request.is_eager:
            raise LockNotAcquired(
                f"{self._label()} runs eagerly and cannot be requeued: lock {key} is held by "
                f"{refusal.holder_id or 'another holder'} or unreachable",
                lock_name=key,
                holder=refusal.holder_id,
                holder_ttl=refusal.ttl,
            )
        line = line_header(request, refusal, decision) if self._in_line else None
        if delay is None and line is not None and not decision.own:
            seen = seen_in_line(request)
            delay = fair_countdown(self.options, attempt, random.random(), refusal, seen)
        elif delay is None:
            delay = requeue_countdown(self.options, attempt, random.random(), decision, refusal)
        own = decision.own
        headers = dict(request.headers or {})
        retries = request.retries or 0
        headers[REQUEUES_HEADER] = [retries, attempt]
        if line is not None:
            headers[QUEUE_HEADER] = line
        if own and recheck:
            headers[SELF_HEADER] = retries
        else:
            headers.pop(SELF_HEADER, None)
        marked = _requeuing.set(True)
        try:
            copy = self.task.signature_from_request(request, countdown=delay, headers=headers)
            copy.apply_async()
        except Exception as exc:
            self._requeue_failed(key, exc)
        finally:
            _requeuing.reset(marked)
        raise Ignore()

    def _requeue_failed(self, key: str, exc: Exception) -> NoReturn:
        """End a run whose requeue could not be published, without losing the call.

        Raises:
            celery.exceptions.Reject: Under ``acks_late``: the broker puts the
                message back, as it would for a worker lost mid-task.
            LockError: Otherwise (the message is already acknowledged): the task
                fails with this reason instead of the publisher's error.
        """
        task, request = self.task, self.task.request
        logger.warning(
            "task %s[%s]: could not requeue for %s (%s); %s",
            task.name,
            request.id,
            key,
            describe_error(exc),
            "the broker redelivers it" if task.acks_late else "it fails",
        )
        if task.acks_late:
            raise Reject(exc, requeue=True) from exc
        raise LockError(
            f"could not requeue for lock {key}: {describe_error(exc)}", lock_name=key
        ) from exc

    @staticmethod
    def _met_itself(request: Any) -> bool:
        """Whether this message was requeued because it met its own task's lock.

        Only for this attempt: a Celery retry copies the headers, and must not
        take its own earlier attempt's result for a sign that it already ran.
        """
        marked = header_of(request, SELF_HEADER)
        return marked is not None and marked == (request.retries or 0)

    def store_failed(self, call: Call, exc: RedisError) -> Any:
        """Apply ``on_redis_error``: run without the lock, requeue, or raise :class:`LockError`."""
        policy = self.options.on_redis_error
        failure = log_store_failure(call.label, call.key, exc, policy, self.log)
        if policy == "run":
            return UNPROTECTED
        if policy == "requeue":
            most, requeues = self.options.max_requeues, requeues_of(self.task.request)
            if decide(Refusal(), None, "requeue", requeues=requeues, max_requeues=most).gave_up:
                raise gave_up(self._label(), call.key, most, Refusal(), exc)
            self._requeue(call.key, Refusal(), Decision("requeue"))
        raise LockError(
            f"lock store {failure} for {call.key}: {describe_error(exc)}", lock_name=call.key
        ) from exc
