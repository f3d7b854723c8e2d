"""The asyncio twin of :func:`~celery_redlock.calls.guarded.run_guarded`, for coroutine calls.

Same order of events and the same :class:`~celery_redlock.calls.guarded.Guard`
hooks (which stay plain functions); only acquiring, running the body and
releasing are awaited. Each call runs in its caller's task, so the context
variable behind ``current_lock()`` is per task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import LockError

from .context import RateSlot, holding, rated
from .guarded import UNPROTECTED, Call, Guard, release_failed

__all__ = ["run_guarded_async"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


async def run_guarded_async(guard: Guard[Any], call: Call, body: Callable[[], Awaitable[T]]) -> T:
    """Await ``body()`` while holding the lock of ``call``, or let ``guard`` resolve why not.

    A call with a rate key is first admitted by its rate limit, as in
    :func:`~celery_redlock.calls.guarded.run_guarded`: the guard's limiter is
    the asyncio one, and a wait in place is an ``asyncio.sleep``.
    """
    slot: RateSlot | None = None
    acquired = False
    started = time.monotonic()
    try:
        lock = guard.new_lock(call)
        # A lock that waits for its holder is taken before the rate slot, so
        # the start falls in the window that counted it (see guarded.py).
        waits = bool(getattr(lock, "blocking", False))
        if call.rate_key is not None and not waits:
            slot = await _admit(guard, call, call.rate_key, started)
            if not slot.verdict.admitted:
                return guard.rate_limited(call, slot.verdict)  # type: ignore[no-any-return]
        acquired = await lock.acquire(token=call.token)
        if acquired and call.rate_key is not None and waits:
            slot = await _admit(guard, call, call.rate_key, started)
    except RedisError as exc:
        if acquired:  # the rate failed after the lock was taken: give it back
            await _release(guard, lock, lock.lease)
        return await _unprotected(guard, call, exc, body)
    if not acquired:
        if slot is not None:
            await _refund(slot)
        return guard.refused(call, lock)  # type: ignore[no-any-return]
    if slot is not None and not slot.verdict.admitted:
        await _release(guard, lock, lock.lease)
        return guard.rate_limited(call, slot.verdict)  # type: ignore[no-any-return]
    lease = lock.lease
    guard.acquired(call, lease)
    try:
        with holding(lease), rated(slot):
            guard.starting(call, lease)
            return await body()
    finally:
        await _release(guard, lock, lease)


async def _release(guard: Guard[Any], lock: Any, lease: Any) -> None:
    try:
        await lock.release()
    except (RedisError, LockError) as error:
        release_failed(lease, guard.kind, error, guard.log)


async def _admit(guard: Guard[Any], call: Call, rate_key: str, started: float) -> RateSlot:
    """Ask the rate limit until it admits or the guard stops waiting (may raise RedisError)."""
    limiter = guard.rate_limiter(call)
    while True:
        verdict = await limiter.acquire(rate_key, call.call_id)
        slot = RateSlot(rate_key, limiter, verdict)
        if verdict.admitted:
            return slot
        delay = guard.rate_retry_in(call, verdict, time.monotonic() - started)
        if delay is None:
            return slot
        await asyncio.sleep(delay)


async def _refund(slot: RateSlot) -> None:
    """Give back a rate admission whose call did not start; a failure only wastes the slot."""
    try:
        await slot.limiter.refund(slot.key, slot.verdict)
    except RedisError as exc:
        logger.warning("could not give back a slot of %s (%s)", slot.key, describe_error(exc))


async def _unprotected(
    guard: Guard[Any], call: Call, exc: RedisError, body: Callable[[], Awaitable[T]]
) -> T:
    outcome = guard.store_failed(call, exc)
    if outcome is not UNPROTECTED:
        return outcome  # type: ignore[no-any-return]
    try:
        return await body()
    finally:
        guard.ran_unprotected(call)
