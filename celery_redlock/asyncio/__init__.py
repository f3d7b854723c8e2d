"""celery-redlock for asyncio: :class:`Lock`, :class:`Redlock`, :class:`Semaphore` (redis.asyncio).

:func:`drain` waits for round trips a Redlock left running in the background.

Import it as ``celery_redlock.asyncio``; it never shadows the standard library's
``asyncio`` because every module of the package imports absolutely.
"""

from __future__ import annotations

from .lock import Lock
from .redlock import Redlock
from .semaphore import Semaphore
from .shielding import drain

__all__ = ["Lock", "Redlock", "Semaphore", "drain"]
