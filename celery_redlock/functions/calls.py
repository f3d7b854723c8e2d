"""One call of a decorated function under its lock: its options and its :class:`Guard`.

A rate limit (``rate=``) is admitted by the shared routine before the lock;
over it, the call skips, raises :class:`~celery_redlock.RateLimited`, or (under
``"wait"``) sleeps exactly until a slot frees, within ``wait_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from celery_redlock.calls.decisions import (
    decide,
    log_rate_limited,
    log_store_failure,
    not_acquired,
    rate_action,
    rate_limited,
    rate_wait,
)
from celery_redlock.calls.guarded import UNPROTECTED, Call, Guard
from celery_redlock.core.admission import admission_lock
from celery_redlock.core.holder import Holder
from celery_redlock.core.rate import Rate, RateVerdict

__all__ = ["CallOptions", "FunctionGuard", "KeptLock"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallOptions:
    """The validated options of one decorated function."""

    name: str
    ttl: float
    on_conflict: str
    wait_timeout: float | None
    wait_sleep: float
    on_redis_error: str
    skipped: Any
    limit: int = 1
    #: ``mode="until_expired"``: seconds an accepted call refuses its duplicates.
    period: float | None = None
    rate: Rate | None = None

    def call(self, key: str, rate_key: str | None = None) -> Call:
        """Describe one call with lock key ``key``: a fresh id names it in the lock and the logs."""
        call_id = uuid.uuid4().hex
        label = f"{self.name}[{call_id}]"
        return Call(key, Holder.new(call_id).encode(), label, call_id, rate_key)


class KeptLock:
    """A call's lock that its end does not release: ``until_expired`` keeps it for its period.

    Everything but :meth:`release` is the wrapped lock's (sync or asyncio);
    the lock was taken for ``period`` seconds without renewal, so it ends by
    expiring, whether or not the call has finished.
    """

    def __init__(self, lock: Any, *, asynchronous: bool) -> None:
        self._lock = lock
        self._asynchronous = asynchronous

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lock, name)

    def release(self) -> Any:
        """Leave the lock to expire; an ``async`` lock gets an awaitable that does the same."""
        return asyncio.sleep(0) if self._asynchronous else None


class FunctionGuard(Guard[Any]):
    """How a decorated function's call is guarded: skip, raise, or (after a wait) raise.

    Args:
        options: The function's options.
        admission_lock: Builds the call's lock or semaphore permit:
            :func:`celery_redlock.core.admission.admission_lock` or its asyncio twin.
        client: The Redis client this call locks with.
        limiter: The rate limiter class (the core's, or the asyncio twin), if
            the function has a rate limit.
    """

    kind = "call"
    log = logger

    def __init__(
        self, options: CallOptions, admission_lock: Any, client: Any, limiter: Any = None
    ) -> None:
        self.options = options
        self.admission_lock = admission_lock
        self.client = client
        self.limiter = limiter
        # One guard per call: a "wait" spent on the rate counts against the lock's wait.
        self.started = time.monotonic()

    def rate_limiter(self, call: Call) -> Any:
        """The call's rate limiter, on the call's client."""
        assert self.options.rate is not None and self.limiter is not None
        return self.limiter(self.client, self.options.rate)

    def rate_retry_in(self, call: Call, verdict: RateVerdict, waited: float) -> float | None:
        """Under ``"wait"``: sleep exactly until a slot frees, while within ``wait_timeout``."""
        if rate_action(self.options.on_conflict) != "wait":
            return None
        return rate_wait(verdict, waited, self.options.wait_timeout)

    def rate_limited(self, call: Call, verdict: RateVerdict) -> Any:
        """Return ``skipped`` under ``"skip"``; otherwise raise.

        Raises:
            RateLimited: Under ``"raise"``, and under ``"wait"`` when a slot would
                not free within ``wait_timeout``.
        """
        options = self.options
        assert options.rate is not None and call.rate_key is not None
        action = rate_action(options.on_conflict)
        outcome = "skip" if action == "skip" else "raise"
        log_rate_limited(call, options.rate, verdict, outcome, self.log)
        if action == "skip":
            return options.skipped
        raise rate_limited(call.label, call.rate_key, options.rate, verdict)

    def new_lock(self, call: Call) -> Any:
        """Build the lock of one call (auto-renewed; blocking only under ``"wait"``).

        Under ``limit`` above 1 it is a semaphore permit; a ``"wait"`` then
        waits its turn on the semaphore's wait list, first come, first served.
        Under a rate, the wait for the lock gets what the rate's wait left of
        ``wait_timeout``.
        """
        options = self.options
        timeout = options.wait_timeout
        if timeout is not None and options.rate is not None:
            timeout = max(0.0, timeout - (time.monotonic() - self.started))
        lock = self.admission_lock(
            self.client,
            call.key,
            limit=options.limit,
            timeout=options.ttl if options.period is None else options.period,
            sleep=options.wait_sleep,
            blocking=options.on_conflict == "wait",
            blocking_timeout=timeout,
            thread_local=False,
            auto_renew=options.period is None,
            label=call.label,
        )
        if options.period is None:
            return lock
        return KeptLock(lock, asynchronous=self.admission_lock is not admission_lock)

    def refused(self, call: Call, lock: Any) -> Any:
        """Return ``skipped`` under ``"skip"``; otherwise raise.

        Raises:
            LockNotAcquired: Under ``"raise"``, and under ``"wait"`` once the wait ran out.
        """
        options, refusal = self.options, lock.refusal
        if decide(refusal, None, options.on_conflict).action == "skip":
            logger.info(
                "%s: %s holds lock %s; skip", options.name, refusal.describe("call"), call.key
            )
            return options.skipped
        waited = " within wait_timeout" if options.on_conflict == "wait" else ""
        raise not_acquired(options.name, call.key, refusal, "call", waited)

    def store_failed(self, call: Call, exc: RedisError) -> Any:
        """Run without the lock under ``on_redis_error="run"`` (logged); otherwise re-raise."""
        if self.options.on_redis_error != "run":
            raise exc
        log_store_failure(self.options.name, call.key, exc, "run", self.log)
        return UNPROTECTED
