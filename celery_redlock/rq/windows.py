"""RQ's side of the windows that keep the newest call or limit by time.

:func:`celery_redlock.rq.enqueue_once` takes ``mode=``:

* ``"debounce"`` (``debounce=``, ``debounce_max_wait=``) and
  ``"until_and_while_executing"`` with ``keep="latest"``: each call draws the
  next generation of its key (one ``STAMP``) and is enqueued, after the
  debounce delay as a scheduled job, with its generation in ``job.meta``.
  A :func:`~celery_redlock.rq.singleton_job` function then runs only the job
  that still carries the newest generation (:func:`newest_lock`); an older job
  finishes without running, returning its ``skipped`` value, with
  ``meta[SUPERSEDED_META]`` naming the job that replaced it (:func:`retired`).
* ``"until_expired"`` (``period=``): the first call takes a marker that lasts
  the period; until then identical calls get that job back.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, cast

from redis.exceptions import RedisError
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job

from celery_redlock.calls.options import Keep, LockOptions, Mode, validate
from celery_redlock.calls.windows import check_window
from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import ConfigurationError, DuplicateTask
from celery_redlock.core.newest import (
    NewestLock,
    Stamp,
    generation_key,
    parse_stamp,
    script_ms,
    stamp,
    unstamp,
)
from celery_redlock.core.window_scripts import RESERVE

__all__ = [
    "GENERATION_META",
    "RQ_MODES",
    "SUPERSEDED_META",
    "enqueue_newest",
    "enqueue_period",
    "newest_lock",
    "retired",
    "window_options",
]

logger = logging.getLogger(__name__)

#: ``job.meta`` entry of a job in a newest-call window: ``{"stamp", "quiet", "keep"}``.
GENERATION_META = "x_redlock_generation"
#: ``job.meta`` entry of a job another job replaced: ``{"by": job id, "key": lock key}``.
SUPERSEDED_META = "x_redlock_superseded"
#: The values ``enqueue_once(mode=...)`` takes.
RQ_MODES = ("until_executed", "until_expired", "debounce", "until_and_while_executing")

#: ``enqueue_call`` options that place the job (``enqueue_job``'s) rather than describe it.
_PLACEMENT = ("at_front", "pipeline", "unique")

#: Builds a key for the function's arguments.
KeyFor = Callable[..., str]


def window_options(mode: str, period: Any, debounce: Any, max_wait: Any, keep: Any) -> LockOptions:
    """Validate ``enqueue_once``'s window options together.

    Raises:
        ConfigurationError: Naming the option at fault.
    """
    if mode not in RQ_MODES:
        raise ConfigurationError("mode", mode, f"must be one of {', '.join(RQ_MODES)}")
    options = LockOptions(
        mode=validate("mode", mode),
        period=validate("period", period),
        debounce=validate("debounce", debounce),
        debounce_max_wait=validate("debounce_max_wait", max_wait),
        keep=validate("keep", keep),
    )
    check_window(options, lambda name: name)
    if options.mode is Mode.UNTIL_AND_WHILE_EXECUTING and options.keep is not Keep.LATEST:
        raise ConfigurationError(
            "keep", options.keep.value, "enqueue_once takes until_and_while_executing with 'latest'"
        )
    return options


def enqueue_period(
    queue: Queue,
    func: Callable[..., Any],
    call: tuple[Sequence[Any], Mapping[str, Any]],
    key: str,
    period: float,
    enqueue_options: Mapping[str, Any],
) -> Job:
    """Enqueue the call unless one was accepted within ``period``; then return that job.

    Raises:
        DuplicateTask: The accepted job no longer exists (its result expired)
            while its period lasts; names it and the seconds left.
    """
    args, kwargs = call
    marker = f"{key}:period"
    new_id = uuid.uuid4().hex
    reply = RESERVE(queue.connection, (marker,), (new_id, script_ms(period), ""))
    if reply == 1:
        return queue.enqueue_call(
            func, args=tuple(args), kwargs=dict(kwargs), job_id=new_id, **enqueue_options
        )
    pttl_ms, held = reply
    held_id = held.decode() if isinstance(held, bytes) else str(held)
    try:
        return queue.job_class.fetch(held_id, connection=queue.connection)
    except NoSuchJobError:
        raise DuplicateTask(
            f"job {held_id} was accepted for {key} within its period and no longer exists",
            lock_name=marker,
            task_id=held_id,
            holder_ttl=pttl_ms / 1000 if pttl_ms >= 0 else None,
        ) from None


def enqueue_newest(
    queue: Queue,
    func: Callable[..., Any],
    call: tuple[Sequence[Any], Mapping[str, Any]],
    key: str,
    options: LockOptions,
    enqueue_options: Mapping[str, Any],
) -> Job:
    """Stamp the call with its key's next generation and enqueue it (scheduled if debounced).

    Older jobs of the key retire when a worker picks them up.

    Raises:
        ConfigurationError: ``func`` is no :func:`~celery_redlock.rq.singleton_job`
            (nothing at the worker would retire the older jobs).
    """
    if not getattr(func, "__redlock_job__", False):
        raise ConfigurationError(
            "mode",
            options.mode.value,
            f"needs a singleton_job function, whose runs retire superseded jobs; "
            f"{getattr(func, '__qualname__', func)!r} is not one",
        )
    args, kwargs = call
    new_id = uuid.uuid4().hex
    keep_for = 600.0 + (options.debounce_max_wait or options.debounce or 0)
    drawn = stamp(
        queue.connection,
        key,
        new_id,
        debounce=options.debounce,
        max_wait=options.debounce_max_wait,
        keep_for=keep_for,
    )
    meta = dict(enqueue_options.get("meta") or {})
    meta[GENERATION_META] = {
        "stamp": drawn.encode(),
        "quiet": options.debounce or 0,
        "keep": keep_for,
    }
    job_options = {**enqueue_options, "meta": meta}
    # What enqueue_call passes to enqueue_job rather than to create_job.
    placed = {name: job_options.pop(name) for name in _PLACEMENT if name in job_options}
    at_front = bool(placed.pop("at_front", False))
    try:
        job = queue.create_job(
            func, args=tuple(args), kwargs=dict(kwargs), job_id=new_id, **job_options
        )
        if drawn.delay > 0:
            # RQ's scheduler keeps whole seconds: round up, never run early.
            when = math.ceil(time.time() + drawn.delay)
            return queue.schedule_job(job, datetime.fromtimestamp(when, timezone.utc), **placed)
        return queue.enqueue_job(job, at_front=at_front, **placed)
    except BaseException:
        _give_back(queue, key, new_id, drawn)
        raise


def _give_back(queue: Queue, key: str, job_id: str, drawn: Stamp) -> None:
    """Unstamp a job that was never enqueued; a store error is logged, not raised over the cause."""
    try:
        unstamp(queue.connection, key, job_id, drawn)
    except RedisError as exc:
        logger.warning(
            "job %s: enqueue failed and its generation of %s could not be given back (%s); "
            "the job it replaced retires as superseded",
            job_id,
            key,
            describe_error(exc),
        )


def newest_lock(job: Job | None, client: Any, key: str, **lock_options: Any) -> NewestLock | None:
    """The lock of a job enqueued in a newest-call window, or ``None`` for any other job."""
    meta = job.meta.get(GENERATION_META) if job is not None else None
    if not isinstance(meta, dict) or job is None:
        return None
    return NewestLock(
        client,
        key,
        stamp=parse_stamp(meta.get("stamp")),
        task_id=job.id,
        keep_ms=script_ms(float(meta.get("keep", 600))),
        **lock_options,
    )


def retired(job: Job | None, lock: Any, key: str, skipped: Any) -> tuple[bool, Any]:
    """Settle a refused :class:`NewestLock`: a superseded job finishes, a recovered one waits.

    Returns:
        ``(True, outcome)`` when settled here (``skipped``, or an RQ ``Retry``
        after one quiet time); ``(False, None)`` when another job runs (the
        caller applies ``on_conflict``).
    """
    if not isinstance(lock, NewestLock) or job is None:
        return False, None
    if lock.superseded_by is not None:
        logger.info("job %s: superseded by job %s; not running", job.id, lock.superseded_by)
        job.meta[SUPERSEDED_META] = {"by": lock.superseded_by, "key": key}
        cast(Any, job).save_meta()  # untyped in RQ
        return True, skipped
    if lock.recovered:
        quiet = float(job.meta[GENERATION_META].get("quiet") or 1)
        logger.warning(
            "job %s: the generation of %s was lost; it stands as the newest and waits %ss",
            job.id,
            generation_key(key),
            quiet,
        )
        return True, Retry(max=(job.number_of_retries or 0) + 1, interval=math.ceil(quiet))
    return False, None
