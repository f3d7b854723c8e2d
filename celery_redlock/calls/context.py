"""The lock held by the running call, as a context variable: :func:`current_lock`.

Every integration that runs code under a lock (the Celery guard, the
:func:`~celery_redlock.singleton` decorator, RQ jobs, the asyncio call) sets the
same variable, so one function answers "which lock am I under?" everywhere. A
context variable rather than a thread-local: thread pools, gevent greenlets and
asyncio tasks each see their own value. This module imports no framework.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from celery_redlock.core.lock import Lease
from celery_redlock.core.rate import RateVerdict

__all__ = [
    "RateSlot",
    "back_off",
    "back_off_async",
    "current_lock",
    "current_rate",
    "hold",
    "holding",
    "let_go",
    "rated",
]

_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "celery_redlock_current_lock", default=None
)


def current_lock() -> Lease | None:
    """Return the lease of the lock held by the running task, if it holds one.

    Read ``fence`` to tag writes, and ``lost`` (or ``remaining()``) to check
    the lock is still held before doing something irreversible.
    """
    return _current.get()


class _Holding:
    """The ``with`` block of :func:`holding`: a class, not a generator (it wraps every call)."""

    __slots__ = ("lease", "token")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    def __enter__(self) -> Lease:
        self.token = _current.set(self.lease)
        return self.lease

    def __exit__(self, *exc_info: object) -> None:
        _current.reset(self.token)


def holding(lease: Lease) -> _Holding:
    """Make ``lease`` what :func:`current_lock` returns inside the ``with`` block."""
    return _Holding(lease)


def hold(lease: Lease) -> contextvars.Token[Lease | None]:
    """Make ``lease`` what :func:`current_lock` returns until :func:`let_go` (no ``with``).

    For the plain guarded path, which runs once per task: a ``try``/``finally``
    around these two costs less than entering and leaving a ``with`` block.
    """
    return _current.set(lease)


def let_go(token: contextvars.Token[Lease | None]) -> None:
    """Undo the :func:`hold` that returned ``token``."""
    _current.reset(token)


@dataclass(frozen=True)
class RateSlot:
    """The rate key the running call was admitted to, the limiter, and its admission.

    Attributes:
        key: The rate key.
        limiter: The limiter that admitted the call: the core
            :class:`~celery_redlock.core.rate.RateLimiter`, or its asyncio twin
            in an ``async def`` call.
        verdict: The admission: ``at_ms`` (server time of the start) and ``used``.
    """

    key: str
    limiter: Any
    verdict: RateVerdict


_rate_slot: contextvars.ContextVar[RateSlot | None] = contextvars.ContextVar(
    "celery_redlock_rate_slot", default=None
)


@contextlib.contextmanager
def rated(slot: RateSlot | None) -> Iterator[RateSlot | None]:
    """Make ``slot`` the rate key that :func:`back_off` blocks inside the ``with`` block."""
    token = _rate_slot.set(slot)
    try:
        yield slot
    finally:
        _rate_slot.reset(token)


def current_rate() -> RateSlot | None:
    """The rate admission of the running call, if it has a rate limit (``lock_rate``)."""
    return _rate_slot.get()


def back_off(seconds: float) -> float:
    """Hold back every call with the running call's rate key for ``seconds``.

    For a task told by an upstream to slow down (an HTTP 429 with
    ``Retry-After``): calls of the same rate key, on every worker, are refused
    until then and come back when the block ends (``lock_on_conflict``). A
    longer block already in place is kept. Returns how long the block lasts.

    Raises:
        RuntimeError: Outside a call with a rate limit (``lock_rate``), or in an
            ``async def`` call (await :func:`back_off_async` there).
        ValueError: If ``seconds`` is not positive.
        redis.exceptions.RedisError: When the lock store fails.
    """
    slot = _slot("back_off")
    if inspect.iscoroutinefunction(slot.limiter.back_off):
        raise RuntimeError("an async def call backs off with: await back_off_async(seconds)")
    return float(slot.limiter.back_off(slot.key, seconds))


async def back_off_async(seconds: float) -> float:
    """:func:`back_off` for the body of an ``async def`` call with a rate limit.

    Raises:
        RuntimeError: Outside a call with a rate limit, or in a plain (sync) call.
        ValueError: If ``seconds`` is not positive.
        redis.exceptions.RedisError: When the lock store fails.
    """
    slot = _slot("back_off_async")
    if not inspect.iscoroutinefunction(slot.limiter.back_off):
        raise RuntimeError("a plain call backs off with back_off(seconds), without await")
    return float(await slot.limiter.back_off(slot.key, seconds))


def _slot(caller: str) -> RateSlot:
    slot = _rate_slot.get()
    if slot is None:
        raise RuntimeError(
            f"{caller}() is for the body of a call with a rate limit (lock_rate, rate=)"
        )
    return slot
