"""celery-redlock: Redis locks that stop Celery tasks from running twice at once.

The lock core (:class:`Lock`, :class:`Redlock`, :class:`Semaphore`, :class:`Lease`,
:class:`Watchdog`) does not use Celery and serves any Python program; :class:`SingletonTask` and
:func:`current_lock` are the Celery integration. :func:`singleton` locks any function,
``celery_redlock.rq`` RQ jobs, and ``celery_redlock.asyncio`` has the lock for asyncio.

The names below are loaded on first use, so ``from celery_redlock import Lock``
imports the lock core only: an RQ or plain-function program never loads Celery.
The folders show the layers (see docs/architecture.md): ``core`` (the lock),
``calls`` (the guarded call), ``celery``, ``rq``, ``functions`` and ``asyncio``
(the integrations) and ``ops`` (the command line).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .calls.context import back_off, back_off_async, current_lock, current_rate
    from .celery.install import install
    from .celery.result import SKIPPED, SUPERSEDED
    from .celery.task import SingletonTask
    from .core.exceptions import (
        ConfigurationError,
        DuplicateSkipped,
        DuplicateTask,
        LockError,
        LockKeyError,
        LockNotAcquired,
        LockNotOwned,
        QuorumNotAchieved,
        RateLimited,
        RedlockError,
        ReplicationError,
    )
    from .core.lease import Lease
    from .core.lock import Lock
    from .core.lock_options import fence_key_for
    from .core.permit import PermitLease
    from .core.redlock import Redlock
    from .core.redlock_lease import RedlockLease
    from .core.renewal import Watchdog, default_watchdog
    from .core.semaphore import Semaphore
    from .functions.decorator import singleton

__all__ = [
    "SKIPPED",
    "SUPERSEDED",
    "ConfigurationError",
    "DuplicateSkipped",
    "DuplicateTask",
    "Lease",
    "Lock",
    "LockError",
    "LockKeyError",
    "LockNotAcquired",
    "LockNotOwned",
    "PermitLease",
    "QuorumNotAchieved",
    "RateLimited",
    "Redlock",
    "RedlockError",
    "RedlockLease",
    "ReplicationError",
    "Semaphore",
    "SingletonTask",
    "Watchdog",
    "__version__",
    "back_off",
    "back_off_async",
    "current_lock",
    "current_rate",
    "default_watchdog",
    "fence_key_for",
    "install",
    "singleton",
]

__version__ = "0.1.0.dev0"

#: Where each public name lives; importing the package loads none of them.
_HOMES = {
    "SKIPPED": "celery.result",
    "SUPERSEDED": "celery.result",
    "SingletonTask": "celery.task",
    "install": "celery.install",
    "back_off": "calls.context",
    "back_off_async": "calls.context",
    "current_lock": "calls.context",
    "current_rate": "calls.context",
    "singleton": "functions.decorator",
    "Lease": "core.lease",
    "Lock": "core.lock",
    "fence_key_for": "core.lock_options",
    "Redlock": "core.redlock",
    "RedlockLease": "core.redlock_lease",
    "Semaphore": "core.semaphore",
    "PermitLease": "core.permit",
    "Watchdog": "core.renewal",
    "default_watchdog": "core.renewal",
    **dict.fromkeys(
        (
            "ConfigurationError",
            "DuplicateSkipped",
            "DuplicateTask",
            "LockError",
            "LockKeyError",
            "LockNotAcquired",
            "LockNotOwned",
            "QuorumNotAchieved",
            "RateLimited",
            "RedlockError",
            "ReplicationError",
        ),
        "core.exceptions",
    ),
}

# The flat layout's module paths (``celery_redlock.lock`` ...) stay importable,
# with a warning, from stubs kept out of the package's own folders.
__path__.append(os.path.join(os.path.dirname(__file__), "_deprecated"))


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'celery_redlock' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
