"""Where a :class:`~celery_redlock.core.lock.Lock` keeps what its latest acquire left.

The token, the :class:`~celery_redlock.core.lease.Lease`, who held the key
when an acquire was refused, and why it failed: per thread (redis-py's
``thread_local=True``, the default) or shared by every thread using the lock.
"""

from __future__ import annotations

import threading
from typing import Union

from .exceptions import LockError
from .lease import Lease

__all__ = ["LockState", "SharedState", "ThreadState"]


class ThreadState(threading.local):
    """One thread's token, lease, refusal and failure (``thread_local=True``)."""

    # Class attributes are the per-thread defaults of a threading.local subclass.
    token: bytes | None = None
    lease: Lease | None = None
    holder: tuple[str | None, float | None] | None = None
    # A refusal's place in line (rank, waiters, arrival in us, server ms).
    place: tuple[int, int, int, int] | None = None
    # Why the latest attempt failed, when a subclass knows more than the holder.
    failure: LockError | None = None


class SharedState:
    """The token, lease, refusal and failure every thread shares (``thread_local=False``)."""

    # Class attributes are the defaults, as for ThreadState: a lock per task
    # call makes one of these, and an __init__ setting five fields cost more
    # than the rest of its construction.
    token: bytes | None = None
    lease: Lease | None = None
    holder: tuple[str | None, float | None] | None = None
    place: tuple[int, int, int, int] | None = None
    failure: LockError | None = None


#: Either kind of state.
LockState = Union[ThreadState, SharedState]
