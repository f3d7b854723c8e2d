"""The lock an ``async def`` guarded call takes: a :class:`Lock`, or a :class:`Semaphore`.

The twin of :func:`celery_redlock.core.admission.admission_lock`.
"""

from __future__ import annotations

from typing import Any, Union

from celery_redlock.core.permit import check_limit

from .lock import Lock
from .semaphore import Semaphore

__all__ = ["AdmissionLock", "admission_lock"]

#: What :func:`admission_lock` returns; both have the same acquire/release/lease/refusal.
AdmissionLock = Union[Lock, Semaphore]


def admission_lock(client: Any, name: str, *, limit: int = 1, **options: Any) -> AdmissionLock:
    """Return the lock of a call on ``name``: a :class:`Lock`, or a semaphore of ``limit`` permits.

    Args:
        client: A ``redis.asyncio.Redis`` client.
        name: The lock key.
        limit: Most holders at once; 1 is a plain lock.
        **options: Keyword arguments both classes take.

    Raises:
        ConfigurationError: For a bad ``limit`` or option, naming it.
    """
    if check_limit("limit", limit) == 1:
        return Lock(client, name, **options)
    return Semaphore(client, name, limit=limit, **options)
