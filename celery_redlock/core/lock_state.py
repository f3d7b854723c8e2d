"""Where a :class:`~celery_redlock.core.lock.Lock` or a semaphore keeps what an acquire left.

The token, the :class:`~celery_redlock.core.lease.Lease`, who held the key
when an acquire was refused, and why it failed: per thread (redis-py's
``thread_local=True``, the default) or shared by every thread using the lock.
"""

from __future__ import annotations

import threading
from typing import Union

from .exceptions import LockError
from .holder import Refusal
from .lease import Lease

__all__ = ["LockState", "SharedState", "ThreadState"]


class _Fields:
    # Class attributes are the defaults: a lock per task call makes a state,
    # and an __init__ setting six fields cost more than the rest of its
    # construction. A threading.local subclass reads them as every thread's.
    token: bytes | None = None
    lease: Lease | None = None
    holder: tuple[str | None, float | None] | None = None
    # A refusal's place in line (rank, waiters, arrival in us, server ms).
    place: tuple[int, int, int, int] | None = None
    # Why the latest attempt failed, when a subclass knows more than the holder.
    failure: LockError | None = None
    # A refusal reported in full (a semaphore's: how full, how many wait).
    refusal: Refusal | None = None


class ThreadState(threading.local, _Fields):
    """One thread's token, lease, refusal and failure (``thread_local=True``)."""


class SharedState(_Fields):
    """The token, lease, refusal and failure every thread shares (``thread_local=False``)."""


#: Either kind of state.
LockState = Union[ThreadState, SharedState]
