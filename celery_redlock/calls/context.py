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
from collections.abc import Iterator

from celery_redlock.core.lock import Lease

__all__ = ["current_lock", "holding"]

_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "celery_redlock_current_lock", default=None
)


def current_lock() -> Lease | None:
    """Return the lease of the lock held by the running task, if it holds one.

    Read ``fence`` to tag writes, and ``lost`` (or ``remaining()``) to check
    the lock is still held before doing something irreversible.
    """
    return _current.get()


@contextlib.contextmanager
def holding(lease: Lease) -> Iterator[Lease]:
    """Make ``lease`` what :func:`current_lock` returns inside the ``with`` block."""
    token = _current.set(lease)
    try:
        yield lease
    finally:
        _current.reset(token)
