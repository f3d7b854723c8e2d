"""``SingletonTask``: a Celery task base class whose calls never run twice at once."""

from __future__ import annotations

import logging
import weakref
from functools import partial
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore

from celery_redlock.calls.options import OPTIONS
from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.keys import KeyBuilder, KeySpec

from . import publish
from .guards import guard_for
from .inside import called_inside, enter, leave
from .install import connect_worker
from .newest import NewestGuard, publish_newest
from .queues import locked_queue
from .result import SingletonResult
from .settings import (
    check_limit_store,
    check_mode_store,
    check_rate,
    lock_url,
    resolve,
    unknown_task_options,
    validate_settings,
)

__all__ = ["SingletonTask"]

logger = logging.getLogger(__name__)

# The task classes whose unprefixed options were pointed out: Celery may bind a
# class more than once, and one warning says it.
_pointed_out: weakref.WeakSet[type] = weakref.WeakSet()


class SingletonTask(Task):  # type: ignore[misc]  # celery ships no type hints
    """A task that takes a Redis lock keyed by its arguments before it runs.

    Use it as ``@app.task(base=SingletonTask)``. Options are task attributes,
    settable in the decorator; ``None`` means "use the app setting
    ``redlock_<name>``, else the default" (see :class:`celery_redlock.calls.options.LockOptions`).

    Attributes:
        lock_ttl: Lock time to live in seconds; renewed while the task runs.
        lock_key: ``None`` (all arguments), argument names, or ``(args, kwargs) -> str``.
        lock_on_conflict: ``"skip"``, ``"requeue"`` or ``"raise"``.
        lock_on_redis_error: ``"requeue"``, ``"run"`` or ``"raise"``.
        lock_requeue_delay: First requeue delay in seconds.
        lock_requeue_max_delay: Largest requeue delay in seconds.
        lock_requeue_jitter: Share of each requeue delay drawn at random.
        lock_max_requeues: Most requeues before the task fails.
        lock_key_prefix: Prefix of the lock keys.
        lock_mode: When the lock is held: ``"while_executing"``,
            ``"until_executing"``, ``"until_executed"``,
            ``"until_and_while_executing"``, ``"debounce"`` or
            ``"until_expired"`` (see docs/modes.md).
        lock_on_duplicate: In an enqueue mode, what ``apply_async`` does when a
            copy is already enqueued: ``"return_existing"`` or ``"raise"``.
        lock_enqueue_ttl: Seconds an enqueue lock lasts beyond the countdown/eta.
        lock_limit: Most calls with the same key running at once (default 1);
            above 1 each call takes one permit of a semaphore, and the call
            beyond the limit meets ``lock_on_conflict`` (see docs/limits.md).
        lock_rate: At most this many starts per window and rate key:
            ``"100/m"``, ``"20/s"``, ``"5/h"``, ``"10/5s"`` (see docs/limits.md).
        lock_rate_key: Argument names or ``(args, kwargs) -> str`` making the
            rate key; ``None``: the same arguments as the lock key.
        lock_debounce: ``lock_mode="debounce"``: seconds of quiet after a
            burst's last call; the task then runs once, with its arguments.
        lock_debounce_max_wait: ``lock_mode="debounce"``: the longest a burst
            waits from its first call.
        lock_keep: ``"first"`` (default) or ``"latest"``: with
            ``until_and_while_executing``, a new call replaces the waiting copy.
        lock_period: ``lock_mode="until_expired"``: seconds during which an
            accepted call refuses its duplicates, finished or not.
        lock_fair: ``False`` turns off fair requeue (requeued calls wait in line
            by first arrival; see docs/conflicts.md).
    """

    lock_ttl: ClassVar[float | None] = None
    lock_key: ClassVar[KeySpec] = None
    lock_on_conflict: ClassVar[str | None] = None
    lock_on_redis_error: ClassVar[str | None] = None
    lock_requeue_delay: ClassVar[float | None] = None
    lock_requeue_max_delay: ClassVar[float | None] = None
    lock_requeue_jitter: ClassVar[float | None] = None
    lock_max_requeues: ClassVar[int | None] = None
    lock_key_prefix: ClassVar[str | None] = None
    lock_mode: ClassVar[str | None] = None
    lock_on_duplicate: ClassVar[str | None] = None
    lock_enqueue_ttl: ClassVar[float | None] = None
    lock_limit: ClassVar[int | None] = None
    lock_rate: ClassVar[str | None] = None
    lock_rate_key: ClassVar[KeySpec] = None
    lock_debounce: ClassVar[float | None] = None
    lock_debounce_max_wait: ClassVar[float | None] = None
    lock_keep: ClassVar[str | None] = None
    lock_period: ClassVar[float | None] = None
    lock_fair: ClassVar[bool | None] = None

    # Per-queue locking must not wrap this task's body: it locks itself, once.
    __redlock_guarded__: ClassVar[bool] = True

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Validate the lock options when the task is bound, so bad values fail early.

        This runs when the app is finalized: at worker start and before the
        first publish. It also connects celery-redlock to the app's workers
        (:func:`~celery_redlock.celery.install.connect_worker`: stale-lock
        recovery, lock counters, start-up validation, the SIGKILL release hook),
        so ``install(app)`` is only needed for apps that lock by queue alone.

        Raises:
            ConfigurationError: Naming the setting or task attribute at fault.
        """
        super().on_bound(app)
        if cls.name is None:  # an abstract base class, not a task
            return
        connect_worker(app)
        conf = app.conf
        validate_settings(conf)
        for attribute, closest in unknown_task_options(cls):
            hint = f"; did you mean {closest}?" if closest else ""
            raise ConfigurationError(
                f"{cls.name}.{attribute}",
                getattr(cls, attribute),
                f"is not a lock option of SingletonTask{hint}",
            )
        _point_out_unprefixed_options(cls)
        options = resolve(cls, conf)
        lock_url(conf)
        mode_from = f"{cls.name}.lock_mode" if cls.lock_mode is not None else "redlock_mode"
        check_mode_store(mode_from, options, conf)
        limit_from = f"{cls.name}.lock_limit" if cls.lock_limit is not None else "redlock_limit"
        check_limit_store(limit_from, options, conf)
        KeyBuilder(cls.name, cls.run, options.key, options.key_prefix)
        check_rate(cls, options, conf)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task under its lock; a direct call (``task(...)``) runs it plainly."""
        request = self.request
        if request.called_directly or called_inside(request):
            return super().__call__(*args, **kwargs)
        # Bound now: cheaper than a closure that looks the method up when called.
        body = partial(super().__call__, *args, **kwargs)
        # From a locked queue, that queue's options apply (below the task's own).
        found = locked_queue(self)
        guard = guard_for(self) if found is None else guard_for(self, *found)
        try:
            marked = enter(request)  # guarding(request), without a with block
            try:
                return guard.run(args, kwargs, body, request)
            finally:
                leave(marked)
        except Ignore as ignored:
            # Celery copies every frame of an Ignore's traceback, with its code
            # positions, and formats them (twice): starting it here leaves
            # out the guard's frame (see TaskGuard.run).
            raise ignored.with_traceback(None) from None

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Publish the task; in an enqueue mode, reserve its key first.

        ``while_executing`` publishes exactly as Celery does, with no Redis
        command. The enqueue modes are described in
        :func:`celery_redlock.celery.publish.apply_async`.

        Raises:
            DuplicateTask: A copy is already enqueued and ``lock_on_duplicate``
                is ``"raise"``, or the call belongs to a canvas.
            LockError: The lock store is unreachable and ``lock_on_redis_error``
                is not ``"run"``.
        """
        guard = guard_for(self)
        if guard.options.mode == "while_executing":
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        options.update(producer=producer, link=link, link_error=link_error, shadow=shadow)

        def send(args: Any, kwargs: Any, task_id: str, options: dict[str, Any]) -> Any:
            return super(SingletonTask, self).apply_async(args, kwargs, task_id, **options)

        if isinstance(guard, NewestGuard):
            return publish_newest(guard, send, args, kwargs, task_id, options)
        return publish.apply_async(guard, send, args, kwargs, task_id, options)

    def AsyncResult(self, task_id: str, **kwargs: Any) -> SingletonResult:  # noqa: N802  # Celery's name
        """The result of a call: like Celery's, and ``get()`` ends for a skipped duplicate."""
        return SingletonResult(
            task_id, backend=self.backend, task_name=self.name, app=self._get_app(), **kwargs
        )

    def lock_key_for(self, *args: Any, **kwargs: Any) -> str:
        """Return the lock key a call with these arguments would take.

        Raises:
            LockKeyError: If the arguments cannot make a key.
        """
        return guard_for(self).keys.key_for(args, kwargs)


def _point_out_unprefixed_options(task: type[SingletonTask]) -> None:
    """Warn, once per task class, of lock options given without their ``lock_`` prefix.

    ``@app.task(base=SingletonTask, ttl=30)`` sets an attribute ``ttl`` that
    no lock reads; ``lock_ttl`` was meant. It may also be the task's own
    attribute, so this warns rather than refuses. The classes of
    SingletonTask itself (Celery's ``Task`` among them) are not looked at.
    """
    if task in _pointed_out:
        return
    _pointed_out.add(task)
    found: set[str] = set()
    for klass in task.__mro__:
        if klass not in SingletonTask.__mro__:
            found.update(attribute for attribute in vars(klass) if attribute in OPTIONS)
    for attribute in sorted(found):
        logger.warning(
            "celery-redlock: task %s has an attribute %r, which no lock reads: "
            "lock options take the prefix (did you mean lock_%s?)",
            task.name,
            attribute,
            attribute,
        )
