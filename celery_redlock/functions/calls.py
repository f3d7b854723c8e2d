"""One call of a decorated function under its lock: its options and its :class:`Guard`."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from celery_redlock.calls.decisions import decide, log_store_failure, not_acquired
from celery_redlock.calls.guarded import UNPROTECTED, Call, Guard
from celery_redlock.core.admission import admission_lock
from celery_redlock.core.holder import Holder

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

    def call(self, key: str) -> Call:
        """Describe one call with lock key ``key``: a fresh id names it in the lock and the logs."""
        call_id = uuid.uuid4().hex
        return Call(key, Holder.new(call_id).encode(), f"{self.name}[{call_id}]")


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
    """

    kind = "call"
    log = logger

    def __init__(self, options: CallOptions, admission_lock: Any, client: Any) -> None:
        self.options = options
        self.admission_lock = admission_lock
        self.client = client

    def new_lock(self, call: Call) -> Any:
        """Build the lock of one call (auto-renewed; blocking only under ``"wait"``).

        Under ``limit`` above 1 it is a semaphore permit; a ``"wait"`` then
        waits its turn on the semaphore's wait list, first come, first served.
        """
        options = self.options
        lock = self.admission_lock(
            self.client,
            call.key,
            limit=options.limit,
            timeout=options.ttl if options.period is None else options.period,
            sleep=options.wait_sleep,
            blocking=options.on_conflict == "wait",
            blocking_timeout=options.wait_timeout,
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
