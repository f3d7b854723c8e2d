"""The ``async def`` side of :func:`celery_redlock.singleton`: one call under an asyncio lock."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from redis.exceptions import RedisError

from celery_redlock.asyncio.lock import Lock
from celery_redlock.calls.context import holding
from celery_redlock.core.holder import Holder
from celery_redlock.core.keys import KeyBuilder
from celery_redlock.functions.decorator import (
    CallOptions,
    ClientResolver,
    conflict,
    new_lock,
    released_badly,
    unprotected,
)

__all__ = ["wrap_async"]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def wrap_async(func: F, options: CallOptions, keys: KeyBuilder, clients: ClientResolver) -> F:
    """Wrap coroutine function ``func`` so that each call runs under its lock."""

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = keys.key_for(args, kwargs)
        holder = Holder.new(uuid.uuid4().hex)
        label = f"{options.name}[{holder.task_id}]"
        client, close = clients.get_async()
        try:
            return await _call(client, key, label, holder, args, kwargs)
        finally:
            if close:
                await client.aclose()

    async def _call(
        client: Any, key: str, label: str, holder: Holder, args: Any, kwargs: Any
    ) -> Any:
        lock = new_lock(Lock, client, key, options, label)
        try:
            acquired = await lock.acquire(token=holder.encode())
        except RedisError as exc:
            if options.on_redis_error != "run":
                raise
            unprotected(options.name, key, exc)
            return await func(*args, **kwargs)
        if not acquired:
            return conflict(options, key, lock.local.holder)
        lease = lock.lease
        # Each call runs in its caller's task, so the context variable is per task.
        assert lease is not None
        try:
            with holding(lease):
                return await func(*args, **kwargs)
        finally:
            try:
                await lock.release()
            except Exception as exc:  # the function's outcome stands; say what happened
                released_badly(lease, exc)

    return cast(F, wrapper)
