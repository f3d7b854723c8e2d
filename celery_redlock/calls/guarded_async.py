"""The asyncio twin of :func:`~celery_redlock.calls.guarded.run_guarded`, for coroutine calls.

Same order of events and the same :class:`~celery_redlock.calls.guarded.Guard`
hooks (which stay plain functions); only acquiring, running the body and
releasing are awaited. Each call runs in its caller's task, so the context
variable behind ``current_lock()`` is per task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from celery_redlock.core.exceptions import LockError

from .context import holding
from .guarded import UNPROTECTED, Call, Guard, release_failed

__all__ = ["run_guarded_async"]

T = TypeVar("T")


async def run_guarded_async(guard: Guard[Any], call: Call, body: Callable[[], Awaitable[T]]) -> T:
    """Await ``body()`` while holding the lock of ``call``, or let ``guard`` resolve why not."""
    try:
        lock = guard.new_lock(call)
        acquired = await lock.acquire(token=call.token)
    except RedisError as exc:
        outcome = guard.store_failed(call, exc)
        if outcome is not UNPROTECTED:
            return outcome  # type: ignore[no-any-return]
        try:
            return await body()
        finally:
            guard.ran_unprotected(call)
    if not acquired:
        return guard.refused(call, lock)  # type: ignore[no-any-return]
    lease = lock.lease
    guard.acquired(call, lease)
    try:
        with holding(lease):
            guard.starting(call, lease)
            return await body()
    finally:
        try:
            await lock.release()
        except (RedisError, LockError) as error:
            release_failed(lease, guard.kind, error, guard.log)
