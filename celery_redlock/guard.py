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
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn, TypeVar

from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Reject
from celery.states import READY_STATES
from redis.exceptions import RedisError, ResponseError

from . import signals
from .conf import LockOptions, resolve
from .context import current_lock, holding
from .exceptions import LockError, LockNotAcquired, LockNotOwned, ReplicationError
from .holder import Holder, queue_of
from .keys import KeyBuilder
from .lock import Lease, Lock
from .store import LockStore, store_for

__all__ = [
    "SKIPPED",
    "TaskGuard",
    "called_inside",
    "current_lock",
    "guard_for",
    "guarding",
    "requeuing",
]

logger = logging.getLogger(__name__)

#: Task state recorded for a call skipped because a duplicate held the lock.
#: Not a ready state: ``AsyncResult.get()`` keeps waiting; read ``.state``/``.info``.
SKIPPED = "SKIPPED"

#: Message header counting how often the lock sent this message back to the queue:
#: ``[retries, count]``, so that a Celery retry (which copies the headers) starts
#: its own count.
REQUEUES_HEADER = "x_redlock_requeues"
#: Message header set when a copy was requeued because it met its own task id.
SELF_HEADER = "x_redlock_self"
#: Seconds such a copy, once it holds the lock, waits for the earlier delivery's
#: result to appear before running the task itself.
RESULT_GRACE = 1.0
RESULT_POLL = 0.02

T = TypeVar("T")

# The id of the task whose call runs under a guard in this thread (or greenlet).
_guarded_task_id: ContextVar[str | None] = ContextVar("celery_redlock_guarded_task", default=None)


@contextmanager
def guarding(request: Any) -> Iterator[None]:
    """Mark the task of ``request`` as running under its lock in this context."""
    token = _guarded_task_id.set(request.id)
    try:
        yield
    finally:
        _guarded_task_id.reset(token)


def called_inside(request: Any) -> bool:
    """Whether a call made now is a direct call inside the body of its own guarded run.

    A task calling a task directly (``other(...)``, or itself) runs it as a
    function within the same task: it must not take a lock of its own, and
    above all not meet the lock of the run it is part of. Celery runs such a
    call under a copy of the running request (same id), pushed on the stack,
    so the id is what tells it apart; an eager ``apply()`` gets a new id and
    is locked as usual.
    """
    task_id = request.id
    return task_id is not None and _guarded_task_id.get() == task_id


# Set while the guard republishes a call it did not run (a requeue), so the
# enqueue side can tell it from a retry, which republishes a call that ran.
_requeuing: ContextVar[bool] = ContextVar("celery_redlock_requeuing", default=False)


def requeuing() -> bool:
    """``True`` while the guard is publishing a requeue of the current call."""
    return _requeuing.get()


class TaskGuard:
    """Runs the calls of one task under its lock.

    Args:
        task: The task (a bound ``celery.Task`` instance).
        options: Its resolved lock options.
        store: The lock store (one Redis, Redlock masters, Cluster or Sentinel).
        queue: The locked queue this guard serves, if any. The lock's value
            records it; without it, the queue the delivery's route names.
    """

    def __init__(
        self, task: Any, options: LockOptions, store: LockStore, queue: str | None = None
    ) -> None:
        self.task = task
        self.options = options
        self.store = store
        self.queue = queue
        self.keys = KeyBuilder(task.name, task.run, options.key, options.key_prefix)

    def run(self, args: Sequence[Any], kwargs: Mapping[str, Any], body: Callable[[], T]) -> T:
        """Run ``body`` while holding the lock of this call, or resolve the conflict.

        Raises:
            celery.exceptions.Ignore: When the call is skipped or requeued.
            LockNotAcquired: Under ``on_conflict="raise"``, or when requeues run out.
            LockKeyError: When the arguments cannot make a key.
        """
        try:
            return self._run(args, kwargs, body)
        except Ignore as ignored:
            # Celery copies every frame of an Ignore's traceback (with each code
            # object's position table) into an ExceptionInfo, twice: starting
            # the traceback here leaves out the frames of the conflict handling,
            # about a tenth of what a skipped or requeued duplicate costs.
            raise ignored.with_traceback(None) from None

    def _run(self, args: Sequence[Any], kwargs: Mapping[str, Any], body: Callable[[], T]) -> T:
        task, request = self.task, self.task.request
        task_id = request.id
        key = self.keys.key_for(args, kwargs)
        label = f"task {task.name}[{task_id}]"
        holder = Holder.new(
            request.id,
            request.hostname,
            ttl=self.options.ttl,
            queue=self.queue or queue_of(request.delivery_info),
        )
        try:
            # Inside the try: a Cluster client connects when first built.
            lock = self._new_lock(key, task_id, label)
            acquired = lock.acquire(token=holder.encode())
        except RedisError as exc:
            return self._redis_failed(key, exc, body)
        if not acquired:
            self._conflict(key, lock)
        lease = lock.lease
        assert lease is not None
        logger.debug("%s acquired", lease.describe())
        signals.lock_acquired.send(
            sender=task, task_id=request.id, key=key, fence=lease.fence, ttl=self.options.ttl
        )
        try:
            with holding(lease):
                if self._met_itself(request) and self._already_done(request.id):
                    logger.info("%s: an earlier delivery already ran it; dropping", label)
                    raise Ignore()
                return body()
        finally:
            self._release(lock, lease)

    def _new_lock(self, key: str, task_id: str, label: str) -> Lock:
        """Build the lock one run takes (enqueue modes take it differently).

        Raises:
            redis.exceptions.RedisError: When the store's client cannot be built
                (a Redis Cluster connects to learn its slots).
        """
        return self.store.lock(key, **self._lock_options(task_id, label))

    def _lock_options(self, task_id: str, label: str) -> dict[str, Any]:
        """The options of every run's lock, whichever class takes it."""
        return {
            "timeout": self.options.ttl,
            "blocking": False,
            "thread_local": False,
            "auto_renew": True,
            # Only the id: the lease outlives the run in the watchdog's heap,
            # and the request would keep the call's arguments alive with it.
            "on_lost": lambda lease: self._report_lost(lease, task_id),
            "label": label,
        }

    def _release(self, lock: Lock, lease: Lease) -> None:
        # Runs in the finally of the task body: before Celery stores the result,
        # so a caller that sees the result can enqueue the same call at once.
        owned = True
        try:
            lock.release()
        except LockNotOwned:
            owned = False
            logger.error("%s was lost before the task finished", lease.describe())
        except RedisError as exc:
            logger.warning(
                "%s: release failed (%r); it expires within %ss", lease.describe(), exc, lease.ttl
            )
        else:
            logger.debug("%s released", lease.describe())
        signals.lock_released.send(
            sender=self.task,
            task_id=self.task.request.id,
            key=lease.name,
            fence=lease.fence,
            owned=owned,
        )

    def _report_lost(self, lease: Lease, task_id: str) -> None:
        # Runs on the watchdog thread; the lease has already logged the loss.
        signals.lock_lost.send(
            sender=self.task,
            task_id=task_id,
            key=lease.name,
            fence=lease.fence,
            reason=lease.loss_reason,
        )

    def _conflict(self, key: str, lock: Lock) -> NoReturn:
        task, request = self.task, self.task.request
        value, holder_ttl = lock.local.holder or (None, None)
        holder = Holder.parse(value)
        holder_id = holder.task_id if holder else None
        if holder_id == request.id:
            # A redelivery of this very task: its first delivery holds the lock,
            # alive or dead. Skipping could lose the task for good (if the first
            # delivery died) and running would run it twice at once: wait.
            self._contended(key, holder, "requeue")
            self._requeue(key, holder_id, holder_ttl, own=True)
        action = self.options.on_conflict
        if action == "requeue" and request.is_eager:
            action = "raise"  # see _requeue
        # Out of requeues, the call fails: say so, not that it was requeued.
        gives_up = action == "requeue" and requeues_of(request) >= self.options.max_requeues
        self._contended(key, holder, "raise" if gives_up else action)
        if action == "requeue":
            self._requeue(key, holder_id, holder_ttl)
        if action == "skip":
            self._record_skip(key, holder)
            raise Ignore()
        raise LockNotAcquired(
            f"task {task.name}[{request.id}] not run: {_describe(holder)} holds {key}",
            lock_name=key,
            holder=holder_id,
            holder_ttl=holder_ttl,
        )

    def _contended(self, key: str, holder: Holder | None, action: str) -> None:
        task, request = self.task, self.task.request
        attempt = requeues_of(request)
        logger.info(
            "task %s[%s]: %s holds lock %s; %s",
            task.name,
            request.id,
            _describe(holder),
            key,
            action,
        )
        signals.lock_contended.send(
            sender=task,
            task_id=request.id,
            key=key,
            holder=holder.task_id if holder else None,
            action=action,
            attempt=attempt,
        )

    def _requeue(
        self,
        key: str,
        holder_id: str | None,
        holder_ttl: float | None,
        own: bool = False,
        recheck: bool = True,
        unreachable: RedisError | None = None,
    ) -> NoReturn:
        """Publish this call again with a backoff delay, then end this run with ``Ignore``.

        Under ``acks_late`` the publish happens before Celery acknowledges the
        message, so a crash in between leaves a duplicate, never a loss.

        Raises:
            LockNotAcquired: For an eager call (a requeue would run it again at
                once, inside this call), or when ``max_requeues`` ran out. A
                redelivery meeting its own lock (``own``) never runs out: its
                first delivery either finishes or dies, and the lock expires.
                With ``recheck`` such a copy is marked to drop itself if the
                holder turns out to have finished the task. ``unreachable`` is
                the error of a lock store that could not be reached, when that
                (not a holder) is why the call is requeued.
        """
        task, request = self.task, self.task.request
        attempt = requeues_of(request) + 1
        if request.is_eager:
            raise LockNotAcquired(
                f"task {task.name}[{request.id}] runs eagerly and cannot be requeued: "
                f"lock {key} is held by {holder_id or 'another holder'} or unreachable",
                lock_name=key,
                holder=holder_id,
                holder_ttl=holder_ttl,
            )
        if attempt > self.options.max_requeues and not own:
            why = (
                f"the lock store kept failing for {key} ({unreachable!r})"
                if unreachable is not None
                else f"lock {key} stayed held by {holder_id or 'another holder'}"
            )
            raise LockNotAcquired(
                f"task {task.name}[{request.id}] gave up after "
                f"{self.options.max_requeues} requeues: {why}",
                lock_name=key,
                holder=holder_id,
                holder_ttl=holder_ttl,
            ) from unreachable
        delay = requeue_delay(self.options, attempt, random.random())
        if own and holder_ttl is not None:
            # A dead first delivery frees the lock when its TTL runs out.
            delay = min(delay, holder_ttl + 0.1)
        headers = dict(request.headers or {})
        retries = request.retries or 0
        headers[REQUEUES_HEADER] = [retries, attempt]
        if own and recheck:
            headers[SELF_HEADER] = retries
        else:
            headers.pop(SELF_HEADER, None)
        marked = _requeuing.set(True)
        try:
            task.signature_from_request(request, countdown=delay, headers=headers).apply_async()
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
            "task %s[%s]: could not requeue for %s (%r); %s",
            task.name,
            request.id,
            key,
            exc,
            "the broker redelivers it" if task.acks_late else "it fails",
        )
        if task.acks_late:
            raise Reject(exc, requeue=True) from exc
        raise LockError(f"could not requeue for lock {key}: {exc!r}", lock_name=key) from exc

    def _record_skip(self, key: str, holder: Holder | None) -> None:
        task, request = self.task, self.task.request
        if task.ignore_result or isinstance(task.backend, DisabledBackend):
            return
        try:
            task.update_state(
                state=SKIPPED,
                meta={
                    "reason": "duplicate",
                    "key": key,
                    "holder": holder.task_id if holder else None,
                    "holder_hostname": holder.hostname if holder else None,
                },
            )
        except Exception:  # recording is a courtesy; the skip stands
            logger.warning("task %s[%s]: could not record SKIPPED", task.name, request.id)

    @staticmethod
    def _met_itself(request: Any) -> bool:
        """Whether this message was requeued because it met its own task's lock.

        Only for this attempt: a Celery retry copies the headers, and must not
        take its own earlier attempt's result for a sign that it already ran.
        """
        marked = header_of(request, SELF_HEADER)
        return marked is not None and marked == (request.retries or 0)

    def _already_done(self, task_id: str) -> bool:
        """Whether an earlier delivery of ``task_id`` finished, by its stored state.

        That delivery releases its lock just before Celery stores its result,
        so a copy that took the lock in between would see no result yet and
        run the task again: a state that is not ready is read again for up to
        :data:`RESULT_GRACE` seconds. Only a delivery that died (no result,
        ever) costs the copy that wait.
        """
        if isinstance(self.task.backend, DisabledBackend):
            return False
        deadline = time.monotonic() + RESULT_GRACE
        while True:
            try:
                if self.task.AsyncResult(task_id).state in READY_STATES:
                    return True
            except Exception:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(RESULT_POLL)

    def _redis_failed(self, key: str, exc: RedisError, body: Callable[[], T]) -> T:
        task, request = self.task, self.task.request
        policy = self.options.on_redis_error
        # A server that answered with an error (ACL, wrong type, out of memory)
        # was reached: say so, it needs a different fix than an outage.
        failure = "refused the lock command" if isinstance(exc, ResponseError) else "unreachable"
        if isinstance(exc, ReplicationError):
            failure = "could not have the lock confirmed by its replicas"
        logger.warning(
            "task %s[%s]: lock store %s for %s (%r); %s",
            task.name,
            request.id,
            failure,
            key,
            exc,
            "running WITHOUT the lock" if policy == "run" else policy,
        )
        if policy == "run":
            return body()
        if policy == "requeue":
            self._requeue(key, None, None, unreachable=exc)
        raise LockError(f"lock store {failure} for {key}: {exc!r}", lock_name=key) from exc


def requeue_delay(options: LockOptions, attempt: int, draw: float) -> float:
    """Return the countdown of requeue number ``attempt`` (1-based).

    Exponential from ``requeue_delay``, capped at ``requeue_max_delay``; up to
    ``requeue_jitter`` of it is taken off at random (``draw`` in [0, 1)) so that
    duplicates that collided once do not collide again.
    """
    # The exponent is capped: 2**40 times any delay is past every sane cap.
    delay = min(options.requeue_max_delay, options.requeue_delay * 2 ** min(attempt - 1, 40))
    return float(delay * (1 - options.requeue_jitter * draw))


def requeues_of(request: Any) -> int:
    """How often the lock requeued this attempt of a task (0 after a Celery retry)."""
    value = header_of(request, REQUEUES_HEADER)
    if isinstance(value, (list, tuple)) and len(value) == 2:
        retries, count = value
        return int(count) if retries == (request.retries or 0) else 0
    return int(value or 0)  # a message requeued by an earlier version


def header_of(request: Any, name: str) -> Any:
    """Return message header ``name`` of a task request (or the request attribute of that name)."""
    headers = request.headers or {}
    return headers.get(name, getattr(request, name, None))


def _describe(holder: Holder | None) -> str:
    if holder is None:
        return "another holder"
    return f"task {holder.task_id} (on {holder.hostname}, pid {holder.pid})"


_guards: weakref.WeakKeyDictionary[Any, dict[str | None, TaskGuard]] = weakref.WeakKeyDictionary()


def guard_for(
    task: Any, queue: str | None = None, queue_options: Mapping[str, Any] | None = None
) -> TaskGuard:
    """Return the guard of ``task`` for calls from ``queue``, built on first use in this process.

    Args:
        task: The task.
        queue: The locked queue the call came from, if any.
        queue_options: That queue's entry of ``redlock_queues``.
    """
    per_queue = _guards.get(task)
    if per_queue is None:
        per_queue = _guards[task] = {}
    guard = per_queue.get(queue)
    if guard is None:
        options = resolve(task, task.app.conf, queue, queue_options)
        factory: type[TaskGuard] = TaskGuard
        if options.mode != "while_executing":
            from .enqueue import EnqueueGuard  # enqueue.py builds on this module

            factory = EnqueueGuard
        guard = per_queue[queue] = factory(task, options, store_for(task.app), queue)
    return guard
