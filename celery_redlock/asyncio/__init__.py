"""celery-redlock for asyncio: :class:`Lock`, :class:`Redlock`, :class:`Semaphore` (redis.asyncio).

:class:`RateLimiter` admits calls to a rate key's sliding window (the core's, awaited).

:func:`drain` waits for round trips a Redlock left running in the background.

Import it as ``celery_redlock.asyncio``; it never shadows the standard library's
``asyncio`` because every module of the package imports absolutely. It may
import :mod:`celery_redlock.core` and redis-py, never Celery, RQ or another
integration.
"""

from __future__ import annotations

from .lock import Lock
from .rate import RateLimiter
from .redlock import Redlock
from .semaphore import Semaphore
from .shielding import drain

__all__ = ["Lock", "RateLimiter", "Redlock", "Semaphore", "drain"]
