"""RQ integration: an execution lock for job functions, and enqueue-time deduplication.

See :mod:`celery_redlock.rq.jobs`. It may import :mod:`celery_redlock.core`,
:mod:`celery_redlock.calls`, :mod:`celery_redlock.functions` and RQ, never
Celery. Importing it needs ``rq`` (``pip install celery-redlock[rq]``).
"""

from __future__ import annotations

from .enqueue import enqueue_once
from .jobs import CONFLICT_ACTIONS, REQUEUES_META, SKIP_META, singleton_job
from .windows import SUPERSEDED_META

__all__ = [
    "CONFLICT_ACTIONS",
    "REQUEUES_META",
    "SKIP_META",
    "SUPERSEDED_META",
    "enqueue_once",
    "singleton_job",
]
