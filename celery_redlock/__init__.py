"""celery-redlock: Redis locks that stop Celery tasks from running twice at once.

The lock core (:class:`Lock`, :class:`Redlock`, :class:`Lease`, :class:`Watchdog`) does not use
Celery and serves any Python program; :class:`SingletonTask` and
:func:`current_lock` are the Celery integration. :func:`singleton` locks any function,
``celery_redlock.rq`` RQ jobs, and ``celery_redlock.asyncio`` has the lock for asyncio.
"""

from __future__ import annotations

from .decorator import singleton
from .exceptions import (
    ConfigurationError,
    DuplicateTask,
    LockError,
    LockKeyError,
    LockNotAcquired,
    LockNotOwned,
    QuorumNotAchieved,
    RedlockError,
    ReplicationError,
)
from .guard import SKIPPED, current_lock
from .install import install
from .lock import Lease, Lock, fence_key_for
from .redlock import Redlock, RedlockLease
from .renewal import Watchdog, default_watchdog
from .task import SingletonTask

__all__ = [
    "SKIPPED",
    "ConfigurationError",
    "DuplicateTask",
    "Lease",
    "Lock",
    "LockError",
    "LockKeyError",
    "LockNotAcquired",
    "LockNotOwned",
    "QuorumNotAchieved",
    "Redlock",
    "RedlockError",
    "RedlockLease",
    "ReplicationError",
    "SingletonTask",
    "Watchdog",
    "__version__",
    "current_lock",
    "default_watchdog",
    "fence_key_for",
    "install",
    "singleton",
]

__version__ = "0.1.0.dev0"
