"""``singleton``: run any function under a lock keyed by its arguments, outside Celery.

The decorator brings the Celery task's lock to plain code (cron scripts, web
handlers, asyncio services): the key is built from the call's arguments bound
to the function's signature, exactly as for a task; the lock is renewed while
the function runs, so ``ttl`` only bounds how long a crashed holder blocks
others; and a duplicate call skips, raises, or waits. ``async def`` functions
are wrapped with :class:`celery_redlock.asyncio.Lock` and need a
``redis.asyncio`` client.

Inside the call, :func:`celery_redlock.current_lock` returns the lease (its
``fence`` and ``lost``), as in a task.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from celery_redlock.calls.decisions import rate_keys
from celery_redlock.calls.guarded import run_guarded
from celery_redlock.calls.options import LockOptions, Mode, check_choice, validate
from celery_redlock.core.admission import admission_lock
from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.keys import KeyBuilder, KeySpec
from celery_redlock.core.rate import Rate, RateLimiter

from .calls import CallOptions, FunctionGuard
from .clients import ClientResolver, ClientSource

__all__ = ["CONFLICT_ACTIONS", "REDIS_ERROR_ACTIONS", "singleton"]

F = TypeVar("F", bound=Callable[..., Any])

#: What a call does when another call with the same key holds the lock.
CONFLICT_ACTIONS = ("skip", "raise", "wait")
#: What a call does when the lock store cannot be reached.
REDIS_ERROR_ACTIONS = ("raise", "run")


def _non_negative(setting: str, value: Any, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigurationError(setting, value, "must be a non-negative number of seconds")
    return float(value)


def _period(mode: str, period: Any) -> float | None:
    """The period of ``mode="until_expired"``; refuse the windows a direct call cannot have."""
    window: Mode = validate("mode", mode)
    if window not in (Mode.WHILE_EXECUTING, Mode.UNTIL_EXPIRED):
        raise ConfigurationError(
            "mode",
            window.value,
            "a decorated function runs when called: only 'while_executing' and "
            "'until_expired' apply (debounce and the enqueue windows need a queue: "
            "a Celery task or an RQ job)",
        )
    period = validate("period", period)
    if (period is None) != (window is Mode.WHILE_EXECUTING):
        why = "mode='until_expired' needs it" if period is None else "needs mode='until_expired'"
        raise ConfigurationError("period", period, why)
    return period  # type: ignore[no-any-return]


# long because: its docstring documents each of its sixteen options; the logic is short
def singleton(
    func: F | None = None,
    *,
    client: ClientSource | None = None,
    url: str | None = None,
    key: KeySpec = None,
    ttl: float = 10.0,
    on_conflict: str = "skip",
    wait_timeout: float | None = None,
    wait_sleep: float = 0.1,
    on_redis_error: str = "raise",
    skipped: Any = None,
    key_prefix: str = "redlock",
    name: str | None = None,
    limit: int = 1,
    rate: str | Rate | None = None,
    rate_key: KeySpec = None,
    mode: str = "while_executing",
    period: float | None = None,
) -> Any:
    """Run the decorated function under a Redis lock keyed by its arguments.

    Usable bare-bracketed or not: ``@singleton(client=r)`` or
    ``singleton(func, client=r)``.

    Args:
        func: The function (plain or ``async def``).
        client: A ``redis.Redis`` (for plain functions) or ``redis.asyncio.Redis``
            (for ``async def``), or a function of no arguments returning one.
        url: Instead of ``client``: a Redis URL; one client per process (per
            event loop for ``async def``) is made on first use.
        key: Which arguments identify a call: ``None`` (all), argument names,
            or a callable ``(args, kwargs) -> str``; as the task's ``lock_key``.
        ttl: Lock time to live in seconds; renewed every third of it while the
            function runs.
        on_conflict: ``"skip"`` (return ``skipped`` without running),
            ``"raise"`` (raise :class:`LockNotAcquired`) or ``"wait"`` (block
            until the lock is free, at most ``wait_timeout`` seconds, then raise
            :class:`LockNotAcquired`).
        wait_timeout: Longest wait under ``"wait"``; ``None`` waits for ever.
        wait_sleep: Seconds between attempts under ``"wait"``.
        on_redis_error: ``"raise"`` the redis-py error, or ``"run"`` the function
            without a lock (logged as a WARNING).
        skipped: What a skipped call returns (default ``None``; pass a sentinel
            of your own to tell a skip from a function that returned ``None``).
        key_prefix: Prefix of the lock keys.
        name: The name in the key (default ``module.qualname`` of ``func``).
        limit: Most calls with the same key running at once (default 1). Above
            1 each call takes a permit of a :class:`celery_redlock.Semaphore`;
            the call beyond the limit skips, raises, or waits its turn (first
            come, first served) as ``on_conflict`` says.
        rate: At most this many starts per window and rate key: ``"100/m"``,
            ``"20/s"``, ``"5/h"`` or ``"10/5s"`` (an exact sliding window; see
            docs/limits.md). Over it, ``on_conflict`` applies: ``"skip"``
            returns ``skipped``, ``"raise"`` raises :class:`RateLimited`
            (``retry_after`` says when a slot frees), ``"wait"`` sleeps exactly
            until a slot frees and tries again, within ``wait_timeout``.
        rate_key: Which arguments make the rate key (as ``key``); ``None``:
            the same as the lock key.
        mode: ``"while_executing"`` (default: the lock lasts the call) or
            ``"until_expired"``: an accepted call holds its key for ``period``
            seconds, finished or not, and duplicates meanwhile skip, raise or
            wait. The windows that need a queue (``"debounce"``, the enqueue
            windows, keeping the latest) make no sense for a direct call,
            which runs now: they are refused.
        period: Seconds of ``mode="until_expired"``.

    Raises:
        ConfigurationError: At decoration, for an invalid option, naming it.
    """
    if func is None:
        return functools.partial(
            singleton,
            client=client,
            url=url,
            key=key,
            ttl=ttl,
            on_conflict=on_conflict,
            wait_timeout=wait_timeout,
            wait_sleep=wait_sleep,
            on_redis_error=on_redis_error,
            skipped=skipped,
            key_prefix=key_prefix,
            name=name,
            limit=limit,
            rate=rate,
            rate_key=rate_key,
            mode=mode,
            period=period,
        )
    if not callable(func):
        raise ConfigurationError("func", func, "singleton decorates a function")
    options = CallOptions(
        name=name or f"{func.__module__}.{func.__qualname__}",
        ttl=validate("ttl", ttl),
        on_conflict=check_choice("on_conflict", on_conflict, CONFLICT_ACTIONS),
        wait_timeout=_non_negative("wait_timeout", wait_timeout, allow_none=True),
        wait_sleep=cast(float, _non_negative("wait_sleep", wait_sleep, allow_none=False)),
        on_redis_error=check_choice("on_redis_error", on_redis_error, REDIS_ERROR_ACTIONS),
        skipped=skipped,
        limit=validate("limit", limit),
        rate=validate("rate", rate),
        period=_period(mode, period),
    )
    if options.name and ("{" in options.name or "}" in options.name):
        raise ConfigurationError("name", options.name, "must not contain braces")
    spec = LockOptions(
        key=validate("key", key),
        key_prefix=validate("key_prefix", key_prefix),
        rate=options.rate,
        rate_key=validate("rate_key", rate_key),
    )
    keys = KeyBuilder(options.name, func, spec.key, spec.key_prefix, option="key")
    limits = rate_keys(options.name, func, spec, option="rate_key", key_option="key")
    is_async = inspect.iscoroutinefunction(func)
    clients = ClientResolver(client, url)
    if is_async:
        from .coroutine import wrap_async

        wrapper = wrap_async(func, options, keys, clients, limits)
    else:
        wrapper = _wrap_sync(func, options, keys, clients, limits)
    wrapper.lock_key_for = lambda *args, **kwargs: keys.key_for(args, kwargs)  # type: ignore[attr-defined]
    return wrapper


def _wrap_sync(
    func: F,
    options: CallOptions,
    keys: KeyBuilder,
    clients: ClientResolver,
    limits: KeyBuilder | None,
) -> F:
    limiter = RateLimiter if limits is not None else None

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rate_key = limits.key_for(args, kwargs) if limits is not None else None
        call = options.call(keys.key_for(args, kwargs), rate_key)
        guard = FunctionGuard(options, admission_lock, clients.get(), limiter)
        return run_guarded(guard, call, lambda: func(*args, **kwargs))

    return cast(F, wrapper)
