"""celery-redlock: Redis locks that stop Celery tasks from running twice at once.

The lock core (:class:`Lock`, :class:`Lease`, :class:`Watchdog`) does not use
Celery and serves any Python program.
"""

from __future__ import annotations

from .exceptions import (
    ConfigurationError,
    LockError,
    LockNotAcquired,
    LockNotOwned,
    RedlockError,
)
from .lock import Lease, Lock, fence_key_for
from .renewal import Watchdog, default_watchdog

__all__ = [
    "ConfigurationError",
    "Lease",
    "Lock",
    "LockError",
    "LockNotAcquired",
    "LockNotOwned",
    "RedlockError",
    "Watchdog",
    "__version__",
    "default_watchdog",
    "fence_key_for",
]

__version__ = "0.1.0.dev0"
