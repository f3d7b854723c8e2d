"""The lock a guarded call takes: a :class:`Lock` for one holder, a :class:`Semaphore` for N.

Every integration builds its call's lock here (Celery through
:meth:`~celery_redlock.core.store.LockStore.lock`), so the limit of holders
is one option with one meaning everywhere; the asyncio twin is
:func:`celery_redlock.asyncio.admission.admission_lock`.
"""

from __future__ import annotations

from typing import Any, Union

from .lock import Lock
from .permit import check_limit
from .semaphore import Semaphore

__all__ = ["AdmissionLock", "admission_lock"]

#: What :func:`admission_lock` returns; both have the same acquire/release/lease/refusal.
AdmissionLock = Union[Lock, Semaphore]


def admission_lock(client: Any, name: str, *, limit: int = 1, **options: Any) -> AdmissionLock:
    """Return the lock of a call on ``name``: a :class:`Lock`, or a semaphore of ``limit`` permits.

    Args:
        client: A ``redis.Redis`` client.
        name: The lock key.
        limit: Most holders at once; 1 is a plain lock.
        **options: Keyword arguments both classes take (``timeout``,
            ``blocking``, ``thread_local``, ``auto_renew``, ``on_lost``, ``label``...).

    Raises:
        ConfigurationError: For a bad ``limit`` or option, naming it.
    """
    if check_limit("limit", limit) == 1:
        return Lock(client, name, **options)
    return Semaphore(client, name, limit=limit, **options)
