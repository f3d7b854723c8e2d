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
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, Union, cast

import redis
from redis.exceptions import RedisError

from celery_redlock.calls.context import holding
from celery_redlock.calls.options import OPTIONS
from celery_redlock.core.exceptions import ConfigurationError, LockNotAcquired, LockNotOwned
from celery_redlock.core.holder import Holder
from celery_redlock.core.keys import KeyBuilder, KeySpec
from celery_redlock.core.lock import Lease, Lock

__all__ = ["CONFLICT_ACTIONS", "REDIS_ERROR_ACTIONS", "singleton"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: What a call does when another call with the same key holds the lock.
CONFLICT_ACTIONS = ("skip", "raise", "wait")
#: What a call does when the lock store cannot be reached.
REDIS_ERROR_ACTIONS = ("raise", "run")

#: A client, or a function of no arguments returning one (called on every call).
ClientSource = Union[Any, Callable[[], Any]]


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


def _non_negative(setting: str, value: Any, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigurationError(setting, value, "must be a non-negative number of seconds")
    return float(value)


def _choice(setting: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigurationError(setting, value, f"must be one of {', '.join(choices)}")
    return str(value)


class ClientResolver:
    """Where a decorated function gets its Redis client from, resolved on each call.

    A URL gives one client per process for plain functions (a forked child must
    not share its parent's sockets). For ``async def`` functions it gives a
    client per call, closed afterwards: ``redis.asyncio`` connections belong to
    the loop that opened them and must be closed on it; pass ``client=`` (or a
    factory) to reuse connections across calls.
    """

    def __init__(self, client: ClientSource | None, url: str | None) -> None:
        if (client is None) == (url is None):
            raise ConfigurationError(
                "client", client, "give exactly one of client= (a client or a factory) and url="
            )
        if url is not None and not (isinstance(url, str) and "://" in url):
            raise ConfigurationError("url", url, "must be a redis://, rediss:// or unix:// URL")
        self._client = client
        self._url = url
        self._by_pid: tuple[int, Any] | None = None

    def get(self) -> Any:
        """Return the client for a call of a plain function."""
        if self._client is not None:
            return self._given()
        if self._by_pid is None or self._by_pid[0] != os.getpid():
            assert self._url is not None
            self._by_pid = (os.getpid(), redis.Redis.from_url(self._url))
        return self._by_pid[1]

    def get_async(self) -> tuple[Any, bool]:
        """Return the client for a call of an ``async def`` function, and whether to close it."""
        if self._client is not None:
            return self._given(), False
        from redis import asyncio as redis_asyncio

        assert self._url is not None
        return redis_asyncio.Redis.from_url(self._url), True

    def _given(self) -> Any:
        if callable(self._client) and not hasattr(self._client, "execute_command"):
            return self._client()
        return self._client


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
        )
    if not callable(func):
        raise ConfigurationError("func", func, "singleton decorates a function")
    options = CallOptions(
        name=name or f"{func.__module__}.{func.__qualname__}",
        ttl=OPTIONS["ttl"][0]("ttl", ttl),
        on_conflict=_choice("on_conflict", on_conflict, CONFLICT_ACTIONS),
        wait_timeout=_non_negative("wait_timeout", wait_timeout, allow_none=True),
        wait_sleep=cast(float, _non_negative("wait_sleep", wait_sleep, allow_none=False)),
        on_redis_error=_choice("on_redis_error", on_redis_error, REDIS_ERROR_ACTIONS),
        skipped=skipped,
    )
    if options.name and ("{" in options.name or "}" in options.name):
        raise ConfigurationError("name", options.name, "must not contain braces")
    keys = KeyBuilder(
        options.name,
        func,
        OPTIONS["key"][0]("key", key),
        OPTIONS["key_prefix"][0]("key_prefix", key_prefix),
    )
    is_async = inspect.iscoroutinefunction(func)
    clients = ClientResolver(client, url)
    if is_async:
        from .coroutine import wrap_async

        wrapper = wrap_async(func, options, keys, clients)
    else:
        wrapper = _wrap_sync(func, options, keys, clients)
    wrapper.lock_key_for = lambda *args, **kwargs: keys.key_for(args, kwargs)  # type: ignore[attr-defined]
    return wrapper


def new_lock(lock_class: Any, client: Any, key: str, options: CallOptions, label: str) -> Any:
    """Build the lock of one call (auto-renewed; blocking only under ``"wait"``)."""
    return lock_class(
        client,
        key,
        timeout=options.ttl,
        sleep=options.wait_sleep,
        blocking=options.on_conflict == "wait",
        blocking_timeout=options.wait_timeout,
        thread_local=False,
        auto_renew=True,
        label=label,
    )


def _wrap_sync(func: F, options: CallOptions, keys: KeyBuilder, clients: ClientResolver) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = keys.key_for(args, kwargs)
        holder = Holder.new(uuid.uuid4().hex)
        label = f"{options.name}[{holder.task_id}]"
        lock = new_lock(Lock, clients.get(), key, options, label)
        try:
            acquired = lock.acquire(token=holder.encode())
        except RedisError as exc:
            if options.on_redis_error != "run":
                raise
            unprotected(options.name, key, exc)
            return func(*args, **kwargs)
        if not acquired:
            return conflict(options, key, lock.local.holder)
        lease = lock.lease
        assert lease is not None
        try:
            with holding(lease):
                return func(*args, **kwargs)
        finally:
            try:
                lock.release()
            except Exception as exc:  # the function's outcome stands; say what happened
                released_badly(lease, exc)

    return cast(F, wrapper)


def unprotected(name: str, key: str, exc: RedisError) -> None:
    """Log that a call of ``name`` runs without its lock because the lock store failed."""
    logger.warning(
        "%s: lock store unreachable for %s (%r); running WITHOUT the lock", name, key, exc
    )


def conflict(
    options: CallOptions, key: str, holder_info: tuple[str | None, float | None] | None
) -> Any:
    """Resolve a call that met a held lock: return ``skipped`` or raise.

    Raises:
        LockNotAcquired: Under ``"raise"``, and under ``"wait"`` once the wait ran out.
    """
    value, holder_ttl = holder_info or (None, None)
    holder = Holder.parse(value)
    who = f"call {holder.task_id} (on {holder.hostname}, pid {holder.pid})" if holder else value
    if options.on_conflict == "skip":
        logger.info("%s: %s holds lock %s; skip", options.name, who or "another holder", key)
        return options.skipped
    waited = " within wait_timeout" if options.on_conflict == "wait" else ""
    raise LockNotAcquired(
        f"{options.name} not run: {who or 'another holder'} holds {key}{waited}",
        lock_name=key,
        holder=holder.task_id if holder else value,
        holder_ttl=holder_ttl,
    )


def released_badly(lease: Lease | None, exc: BaseException) -> None:
    """Log a release that failed; the key expires by itself within its TTL."""
    what = lease.describe() if lease is not None else "lock"
    if isinstance(exc, LockNotOwned):
        logger.error("%s was lost before the call finished", what)
    else:
        logger.warning("%s: release failed (%r); it expires within its TTL", what, exc)
