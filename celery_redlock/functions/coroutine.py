"""The ``async def`` side of :func:`celery_redlock.singleton`: one call under an asyncio lock.

With ``limit`` above 1 the call takes an asyncio semaphore permit instead; with
``rate`` it is first admitted by the asyncio rate limiter.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from celery_redlock.asyncio.admission import admission_lock
from celery_redlock.asyncio.rate import RateLimiter
from celery_redlock.calls.guarded_async import run_guarded_async
from celery_redlock.core.keys import KeyBuilder

from .calls import CallOptions, FunctionGuard
from .clients import ClientResolver

__all__ = ["wrap_async"]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def wrap_async(
    func: F,
    options: CallOptions,
    keys: KeyBuilder,
    clients: ClientResolver,
    limits: KeyBuilder | None = None,
) -> F:
    """Wrap coroutine function ``func`` so that each call runs under its lock (and rate)."""
    limiter = RateLimiter if limits is not None else None

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        rate_key = limits.key_for(args, kwargs) if limits is not None else None
        call = options.call(keys.key_for(args, kwargs), rate_key)
        client, close = clients.get_async()
        try:
            guard = FunctionGuard(options, admission_lock, client, limiter)
            return await run_guarded_async(guard, call, lambda: func(*args, **kwargs))
        finally:
            if close:
                await client.aclose()

    return cast(F, wrapper)
