"""celery-redlock for asyncio: a :class:`Lock` for ``redis.asyncio`` clients.

Import it as ``celery_redlock.asyncio``; it never shadows the standard library's
``asyncio`` because every module of the package imports absolutely. The
multi-master :class:`celery_redlock.Redlock` has no asyncio counterpart yet.
"""

from __future__ import annotations

from .lock import Lock

__all__ = ["Lock"]
