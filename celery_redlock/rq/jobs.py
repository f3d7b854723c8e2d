"""RQ integration: an execution lock for job functions, and enqueue-time deduplication.

RQ's own ``job_id`` uniqueness only covers enqueueing while the job's hash
exists; it takes no lock while a job runs, renews nothing and has no fence. Here:

* :func:`singleton_job` wraps a job function so that each run holds a lock keyed
  by its arguments (the same keys as the Celery task and :func:`singleton`),
  renewed while it runs. A duplicate run is skipped, fails with
  :class:`LockNotAcquired`, or is requeued through RQ's own scheduling: it
  returns an RQ ``Retry`` with an exponential, jittered backoff, so the worker
  puts the same job (same id) in the scheduled registry. Requeues need a worker
  started with ``--with-scheduler`` and RQ >= 2.3. With ``rate=`` a run is
  first admitted by its rate key's sliding window; one over it is rescheduled
  the same way, to when a slot frees (not counted as a requeue).
* :func:`~celery_redlock.rq.enqueue.enqueue_once` enqueues a call unless an
  identical one (same lock key) is already queued, scheduled or running, and
  then returns that job instead.

The lock lives on the worker's own Redis connection unless ``client=`` names
another. Importing this module needs ``rq`` (``pip install celery-redlock[rq]``).
"""

from __future__ import annotations

import functools
import logging
import math
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from redis.exceptions import RedisError
from rq import Retry, get_current_job
from rq.job import Job
from rq.version import VERSION as RQ_VERSION

from celery_redlock.calls.decisions import (
    Decision,
    decide,
    gave_up,
    log_rate_limited,
    log_store_failure,
    not_acquired,
    rate_action,
    rate_countdown,
    rate_keys,
    rate_limited,
    requeue_countdown,
)
from celery_redlock.calls.guarded import UNPROTECTED, Call, Guard, run_guarded
from celery_redlock.calls.options import (
    LockOptions,
    OnConflict,
    OnRedisError,
    check_choice,
    validate,
)
from celery_redlock.core.admission import AdmissionLock, admission_lock
from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.holder import Holder, Refusal
from celery_redlock.core.keys import KeyBuilder, KeySpec
from celery_redlock.core.rate import Rate, RateLimiter, RateVerdict

# enqueue_once lived here; kept importable from its old place.
from .enqueue import enqueue_once
from .windows import newest_lock, retired

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


# long because: its docstring documents each of its fifteen options; the logic is short
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
    rate: str | Rate | None = None,
    rate_key: KeySpec = None,
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
        rate: At most this many starts per window and rate key (``"100/m"``,
            ``"20/s"``, ``"10/5s"``; an exact sliding window, see docs/limits.md).
            A run over it is skipped, fails with :class:`RateLimited`, or under
            ``"requeue"`` is rescheduled by RQ to when a slot frees (plus
            jitter, rounded up to whole seconds), not counted in ``max_requeues``.
        rate_key: Which arguments make the rate key (as ``key``); ``None``:
            the same as the lock key.

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
            rate=rate,
            rate_key=rate_key,
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
        rate=validate("rate", rate),
        rate_key=validate("rate_key", rate_key),
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
        self.keys = KeyBuilder(name, func, options.key, options.key_prefix, option="key")
        self.rate_keys = rate_keys(name, func, options, option="rate_key", key_option="key")

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
        if self.rate_keys is not None:
            call.rate_key = self.rate_keys.key_for(args, kwargs)
        return run_guarded(self, call, lambda: self.func(*args, **kwargs))

    def new_lock(self, call: Call) -> AdmissionLock:
        """The run's lock (a semaphore permit under ``limit``), on the client or the job's.

        The client is ``client=`` when given, else the worker's own connection.
        """
        client = self._client(call)
        options: dict[str, Any] = {"timeout": self.options.ttl, "blocking": False}
        options.update(thread_local=False, auto_renew=True, label=call.label)
        newest = newest_lock(_job_of(call, None), client, call.key, **options)
        if newest is not None:  # enqueued by enqueue_once in a newest-call window
            return newest
        return admission_lock(client, call.key, limit=self.options.limit, **options)

    def _client(self, call: Call) -> Any:
        return self.client if self.client is not None else _job_of(call).connection

    def rate_limiter(self, call: Call) -> RateLimiter:
        """The run's rate limiter, on the lock's client."""
        assert self.options.rate is not None
        return RateLimiter(self._client(call), self.options.rate)

    def rate_limited(self, call: Call, verdict: RateVerdict) -> Any:
        """Over the rate: skip (``meta[SKIP_META]`` says why), reschedule with RQ, or raise.

        The reschedule is RQ's own (a returned ``Retry``, the scheduled job
        registry), to when a slot frees plus jitter, in whole seconds; it does
        not count against ``max_requeues``.
        """
        job, rate = _job_of(call, None), self.options.rate
        assert rate is not None and call.rate_key is not None
        action = rate_action(self.options.on_conflict, can_requeue=job is not None)
        log_rate_limited(call, rate, verdict, action, self.log)
        if action == "skip":
            if job is not None:
                job.meta[SKIP_META] = {"key": call.rate_key, "reason": "rate"}
                cast(Any, job).save_meta()  # untyped in RQ
            return self.skipped
        if action == "requeue":
            delay = rate_countdown(self.options, verdict, random.random())
            return _retry(job, delay)
        raise rate_limited(call.label, call.rate_key, rate, verdict)

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
            most, requeues = self.options.max_requeues, int(job.meta.get(REQUEUES_META, 0))
            if decide(Refusal(), None, "requeue", requeues=requeues, max_requeues=most).gave_up:
                raise gave_up(call.label, call.key, most, Refusal(), exc)
            return self._requeue(call, Decision("requeue"), Refusal())
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
    ) -> Retry:
        # decide() already enforced max_requeues (a job meeting its own lock,
        # alive or dead, always waits: its lock ends within the TTL).
        job = _job_of(call)
        attempt = int(job.meta.get(REQUEUES_META, 0)) + 1
        delay = requeue_countdown(self.options, attempt, random.random(), decision, refusal)
        job.meta[REQUEUES_META] = attempt
        cast(Any, job).save_meta()  # untyped in RQ
        return _retry(job, delay)


def _retry(job: Job, delay: float) -> Retry:
    """The ``Retry`` that has RQ schedule ``job`` again in ``delay`` seconds (rounded up).

    One more than the retries RQ has counted, so RQ never fails the job for
    running out: this module counts its own requeues in meta. RQ schedules in
    whole seconds; rounding up never brings a run back before its slot frees.
    """
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
