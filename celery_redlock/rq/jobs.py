"""RQ integration: an execution lock for job functions, and enqueue-time deduplication.

RQ's own ``job_id`` uniqueness only covers enqueueing while the job's hash
exists; it takes no lock while a job runs, renews nothing and has no fence. Here:

* :func:`singleton_job` wraps a job function so that each run holds a lock keyed
  by its arguments (the same keys as the Celery task and :func:`singleton`),
  renewed while it runs. A duplicate run is skipped, fails with
  :class:`LockNotAcquired`, or is requeued through RQ's own scheduling: it
  returns an RQ ``Retry`` with an exponential, jittered backoff, so the worker
  puts the same job (same id) in the scheduled registry. Requeues need a worker
  started with ``--with-scheduler`` and RQ >= 2.3.
* :func:`enqueue_once` enqueues a call unless an identical one (same lock key)
  is already queued, scheduled or running, and then returns that job instead.

The lock lives on the worker's own Redis connection unless ``client=`` names
another. Importing this module needs ``rq`` (``pip install celery-redlock[rq]``).
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from redis.exceptions import RedisError
from rq import Queue, Retry, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.version import VERSION as RQ_VERSION

from celery_redlock.calls.decisions import (
    Decision,
    decide,
    gave_up,
    log_store_failure,
    not_acquired,
    requeue_countdown,
)
from celery_redlock.calls.guarded import UNPROTECTED, Call, Guard, run_guarded
from celery_redlock.calls.options import (
    LockOptions,
    Mode,
    OnConflict,
    OnRedisError,
    check_choice,
    validate,
)
from celery_redlock.core.admission import AdmissionLock, admission_lock
from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.holder import Holder, Refusal
from celery_redlock.core.keys import KeyBuilder, KeySpec
from celery_redlock.core.lua import Script

from .windows import enqueue_newest, enqueue_period, newest_lock, retired, window_options

__all__ = ["CONFLICT_ACTIONS", "REQUEUES_META", "SKIP_META", "enqueue_once", "singleton_job"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: What a run does when another run with the same key holds the lock.
CONFLICT_ACTIONS = ("skip", "raise", "requeue")
#: What a run does when the lock store cannot be reached.
REDIS_ERROR_ACTIONS = ("raise", "run", "requeue")
#: ``job.meta`` entry counting the requeues of a job by its lock.
REQUEUES_META = "x_redlock_requeues"
#: ``job.meta`` entry describing why a run was skipped.
SKIP_META = "x_redlock_skipped"

# Job statuses after which a job will not run again by itself.
_DONE = ("finished", "failed", "stopped", "canceled")

# Claim the enqueue marker of a lock key, unless it names a live job.
#
# KEYS[1]  marker key (the lock key + ":enqueued")
# ARGV[1]  id of the job the caller is about to enqueue
# ARGV[2]  key prefix of RQ job hashes ("rq:job:")
# ARGV[3]  marker lifetime in milliseconds
# ARGV[4]  grace in milliseconds: a claimed id whose job hash does not exist
#          yet counts as being enqueued for this long
# Returns  the id of the live job to reuse, or nil when the marker now names ARGV[1].
#
# The marker value is "<job id>|<claim time in ms>". Job hashes are read by a
# key built here, which Redis Cluster would refuse; RQ does not run on Cluster.
CLAIM = Script(
    "rq_enqueue_claim",
    """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local current = redis.call('GET', KEYS[1])
if current then
  local id, claimed = string.match(current, '^(.*)|(%d+)$')
  if id then
    local status = redis.call('HGET', ARGV[2] .. id, 'status')
    if status then
      if status ~= 'finished' and status ~= 'failed' and status ~= 'stopped'
          and status ~= 'canceled' then
        return id
      end
    elseif now_ms - tonumber(claimed) < tonumber(ARGV[4]) then
      return id
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. string.format('%d', now_ms), 'PX', ARGV[3])
return false
""",
)


# long because: its docstring documents each of its thirteen options; the logic is short
def singleton_job(
    func: F | None = None,
    *,
    key: KeySpec = None,
    ttl: float = 10.0,
    on_conflict: str = "skip",
    on_redis_error: str = "raise",
    requeue_delay: float = 1.0,
    requeue_max_delay: float = 60.0,
    requeue_jitter: float = 0.5,
    max_requeues: int = 100,
    skipped: Any = None,
    key_prefix: str = "redlock",
    name: str | None = None,
    client: Any = None,
    limit: int = 1,
) -> Any:
    """Run each execution of an RQ job function under a lock keyed by its arguments.

    Args:
        func: The job function (module level, as RQ imports it by name).
        key: Which arguments identify a run: ``None`` (all), argument names, or
            a callable ``(args, kwargs) -> str``; as the task's ``lock_key``.
        ttl: Lock time to live in seconds; renewed every third of it while the job runs.
        on_conflict: ``"skip"`` (the job finishes, returning ``skipped``; its
            ``meta[SKIP_META]`` says why), ``"raise"`` (the job fails with
            :class:`LockNotAcquired`) or ``"requeue"`` (the job returns an RQ
            ``Retry``: RQ schedules the same job again after a backoff).
        on_redis_error: ``"raise"``, ``"run"`` (without a lock, logged) or ``"requeue"``.
        requeue_delay: First requeue delay in seconds; doubles each time.
        requeue_max_delay: Cap of the requeue delay in seconds.
        requeue_jitter: Share of each delay taken off at random (0 to 1). RQ
            schedules in whole seconds, so delays are rounded up to one.
        max_requeues: Requeues of one job before it fails with ``LockNotAcquired``.
        skipped: What a skipped run returns (its job's result).
        key_prefix: Prefix of the lock keys.
        name: The name in the key (default ``module.qualname``, RQ's ``func_name``).
        client: Redis client for the lock (default: the worker's connection).
        limit: Most runs with the same key at once (default 1). Above 1 each run
            takes a permit of a :class:`celery_redlock.Semaphore`, and the run
            beyond the limit meets ``on_conflict``; a job meeting a permit of
            its own earlier run (same job id) waits for it, never skips.

    Raises:
        ConfigurationError: At decoration, for an invalid option, naming it.
    """
    if func is None:
        return functools.partial(
            singleton_job,
            key=key,
            ttl=ttl,
            on_conflict=on_conflict,
            on_redis_error=on_redis_error,
            requeue_delay=requeue_delay,
            requeue_max_delay=requeue_max_delay,
            requeue_jitter=requeue_jitter,
            max_requeues=max_requeues,
            skipped=skipped,
            key_prefix=key_prefix,
            name=name,
            client=client,
            limit=limit,
        )
    job_name = name or f"{func.__module__}.{func.__qualname__}"
    if "{" in job_name or "}" in job_name:
        raise ConfigurationError("name", job_name, "must not contain braces")
    options = LockOptions(
        ttl=validate("ttl", ttl),
        key=validate("key", key),
        on_conflict=OnConflict(check_choice("on_conflict", on_conflict, CONFLICT_ACTIONS)),
        on_redis_error=OnRedisError(
            check_choice("on_redis_error", on_redis_error, REDIS_ERROR_ACTIONS)
        ),
        requeue_delay=validate("requeue_delay", requeue_delay),
        requeue_max_delay=validate("requeue_max_delay", requeue_max_delay),
        requeue_jitter=validate("requeue_jitter", requeue_jitter),
        max_requeues=validate("max_requeues", max_requeues),
        key_prefix=validate("key_prefix", key_prefix),
        limit=validate("limit", limit),
    )
    if "requeue" in (options.on_conflict, options.on_redis_error) and not _returns_retry():
        raise ConfigurationError(
            "on_conflict",
            "requeue",
            f"needs RQ >= 2.3, whose workers reschedule a job that returns Retry "
            f"(installed: {RQ_VERSION}); an older worker would finish the job instead",
        )
    runner = _JobRunner(func, job_name, options, skipped, client)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return runner.run(args, kwargs)

    wrapper.lock_key_for = lambda *a, **kw: runner.keys.key_for(a, kw)  # type: ignore[attr-defined]
    wrapper.__redlock_job__ = True  # type: ignore[attr-defined]  # retires superseded jobs
    return wrapper


def _returns_retry() -> bool:
    """Whether this RQ's workers treat a returned ``Retry`` as a request to retry."""
    major, minor = (int(part) for part in RQ_VERSION.split(".")[:2])
    return (major, minor) >= (2, 3)


class _JobRunner(Guard[Any]):
    """Runs the executions of one job function under their locks."""

    kind = "job"
    log = logger

    def __init__(
        self, func: Callable[..., Any], name: str, options: LockOptions, skipped: Any, client: Any
    ) -> None:
        self.func = func
        self.name = name
        self.options = options
        self.skipped = skipped
        self.client = client
        self.keys = KeyBuilder(name, func, options.key, options.key_prefix)

    def run(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Run the job function once under its lock (directly when called outside a worker)."""
        job = get_current_job()
        if self.client is None and job is None:
            # Called directly, outside a worker, as a Celery task's direct call:
            # no job to requeue and no connection to lock with.
            return self.func(*args, **kwargs)
        job_id = job.id if job is not None else uuid.uuid4().hex
        call = _JobCall(
            self.keys.key_for(args, kwargs),
            Holder.new(job_id).encode(),
            f"job {self.name}[{job_id}]",
            job,
        )
        return run_guarded(self, call, lambda: self.func(*args, **kwargs))

    def new_lock(self, call: Call) -> AdmissionLock:
        """The run's lock (a semaphore permit under ``limit``), on the client or the job's.

        The client is ``client=`` when given, else the worker's own connection.
        """
        client = self.client if self.client is not None else _job_of(call).connection
        options: dict[str, Any] = {"timeout": self.options.ttl, "blocking": False}
        options.update(thread_local=False, auto_renew=True, label=call.label)
        newest = newest_lock(_job_of(call, None), client, call.key, **options)
        if newest is not None:  # enqueued by enqueue_once in a newest-call window
            return newest
        return admission_lock(client, call.key, limit=self.options.limit, **options)

    def acquired(self, call: Call, lease: Any) -> None:
        """Log the acquisition (DEBUG)."""
        logger.debug("%s acquired", lease.describe())

    def store_failed(self, call: Call, exc: RedisError) -> Any:
        """Apply ``on_redis_error``: run without the lock, requeue, or raise."""
        policy: str = self.options.on_redis_error
        job = _job_of(call, None)
        if policy == "requeue" and job is None:
            policy = "raise"
        log_store_failure(call.label, call.key, exc, policy, self.log)
        if policy == "run":
            return UNPROTECTED
        if policy == "requeue":
            return self._requeue(call, Decision("requeue"), Refusal(), unreachable=exc)
        raise exc

    def refused(self, call: Call, lock: Any) -> Any:
        """Skip (recording why in ``job.meta``), requeue with an RQ ``Retry``, or raise."""
        job, refusal = _job_of(call, None), lock.refusal
        settled, outcome = retired(job, lock, call.key, self.skipped)
        if settled:  # superseded by a newer job, or waiting for one
            return outcome
        decision = decide(
            refusal,
            call.call_id,
            self.options.on_conflict,
            requeues=int(job.meta.get(REQUEUES_META, 0)) if job is not None else 0,
            max_requeues=self.options.max_requeues,
            can_requeue=job is not None,
        )
        action = "raise" if decision.gave_up else decision.action
        logger.info(
            "%s: %s holds lock %s; %s", self.name, refusal.describe("job"), call.key, action
        )
        if decision.gave_up:
            raise gave_up(call.label, call.key, self.options.max_requeues, refusal)
        if action == "skip":
            if job is not None:
                job.meta[SKIP_META] = {"key": call.key, "holder": refusal.holder_id}
                cast(Any, job).save_meta()  # untyped in RQ
            return self.skipped
        if action == "requeue":
            return self._requeue(call, decision, refusal)
        raise not_acquired(f"job {self.name}", call.key, refusal, "job")

    def _requeue(
        self,
        call: Call,
        decision: Decision,
        refusal: Refusal,
        unreachable: RedisError | None = None,
    ) -> Retry:
        job = _job_of(call)
        attempt = int(job.meta.get(REQUEUES_META, 0)) + 1
        # A job meeting its own lock (a rerun of a job whose first run still
        # holds it, alive or dead) always waits: its lock ends within the TTL.
        if attempt > self.options.max_requeues and not decision.own:
            raise gave_up(call.label, call.key, self.options.max_requeues, refusal, unreachable)
        delay = requeue_countdown(self.options, attempt, random.random(), decision, refusal)
        job.meta[REQUEUES_META] = attempt
        cast(Any, job).save_meta()  # untyped in RQ
        # One more than the retries RQ has counted, so RQ never fails the job
        # for running out: this module counts its own requeues in meta.
        return Retry(max=(job.number_of_retries or 0) + 1, interval=max(1, math.ceil(delay)))


class _JobCall(Call):
    """A job's run: a :class:`Call` that also carries its RQ job."""

    __slots__ = ("job",)

    def __init__(self, key: str, token: str, label: str, job: Job | None) -> None:
        super().__init__(key, token, label, job.id if job is not None else None)
        self.job = job


_MISSING: Any = object()


def _job_of(call: Call, default: Any = _MISSING) -> Any:
    job = call.job if isinstance(call, _JobCall) else None
    if job is None and default is _MISSING:
        raise AssertionError(f"{call.label} runs outside an RQ job")
    return job if job is not None else default


# long because: most of it is the docstring of its options and guarantees
def enqueue_once(
    queue: Queue,
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    marker_ttl: float = 86400.0,
    grace: float = 10.0,
    mode: str = "until_executed",
    period: float | None = None,
    debounce: float | None = None,
    debounce_max_wait: float | None = None,
    keep: str = "first",
    **enqueue_options: Any,
) -> Job:
    """Enqueue ``func(*args, **kwargs)`` unless an identical call is queued or running.

    Two calls are identical when they have the same lock key: for a
    :func:`singleton_job` function its own key options, otherwise all arguments.
    A job that is queued, scheduled (for instance requeued by its lock),
    deferred or started counts; a finished, failed, stopped or canceled one does
    not. The check and the claim are one atomic script, so concurrent callers
    get one job between them.

    Args:
        queue: The RQ queue.
        func: The job function.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        marker_ttl: Seconds the enqueue marker lives; a job still queued after
            that no longer deduplicates.
        grace: Seconds a claimed job id counts as being enqueued before its job
            hash exists (covers the caller between claim and enqueue).
        mode: ``"until_executed"`` (the above), ``"until_expired"`` (``period``),
            ``"debounce"`` (``debounce``, ``debounce_max_wait``) or
            ``"until_and_while_executing"`` with ``keep="latest"``: see
            :mod:`celery_redlock.rq.windows` and docs/modes.md.
        period: Seconds an accepted call refuses identical ones (``until_expired``).
        debounce: Quiet seconds before a debounced burst runs its newest call.
        debounce_max_wait: Longest a debounced burst waits from its first call.
        keep: ``"latest"``: a newer call replaces the waiting job.
        **enqueue_options: Passed to ``Queue.enqueue_call`` (``job_timeout`` as
            ``timeout``, ``result_ttl``, ``meta``...); not ``job_id``.

    Returns:
        The new job, or the live identical one.

    Raises:
        ConfigurationError: If ``enqueue_options`` sets ``job_id``, or a window
            option is bad (naming it).
    """
    if "job_id" in enqueue_options:
        raise ConfigurationError("job_id", enqueue_options["job_id"], "enqueue_once picks the id")
    window = window_options(mode, period, debounce, debounce_max_wait, keep)
    kwargs = dict(kwargs or {})
    key_for = getattr(func, "lock_key_for", None)
    if key_for is None:
        name = f"{func.__module__}.{func.__qualname__}"
        key_for = functools.partial(_default_key, KeyBuilder(name, func, None, "redlock"))
    key = key_for(*args, **kwargs)
    if window.period is not None:
        return enqueue_period(queue, func, (args, kwargs), key, window.period, enqueue_options)
    if window.mode is not Mode.UNTIL_EXECUTED:
        return enqueue_newest(queue, func, (args, kwargs), key, window, enqueue_options)
    marker = f"{key}:enqueued"
    prefix = queue.job_class.key_for("")
    deadline = time.monotonic() + grace + 1.0
    while True:
        new_id = uuid.uuid4().hex
        existing = CLAIM(
            queue.connection,
            (marker,),
            (new_id, prefix, int(marker_ttl * 1000), int(grace * 1000)),
        )
        if existing is None:
            return queue.enqueue_call(
                func, args=tuple(args), kwargs=kwargs, job_id=new_id, **enqueue_options
            )
        existing_id = existing.decode() if isinstance(existing, bytes) else str(existing)
        try:
            return queue.job_class.fetch(existing_id, connection=queue.connection)
        except NoSuchJobError:
            # Claimed by a caller that is enqueueing it right now (or died
            # doing so, and the claim lapses after the grace): look again.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _default_key(keys: KeyBuilder, *args: Any, **kwargs: Any) -> str:
    return keys.key_for(args, kwargs)
