"""The Celery integration: the task class, worker bootsteps, enqueue windows, signals and stats.

It may import :mod:`celery_redlock.core`, :mod:`celery_redlock.calls` and
Celery; nothing outside this folder imports it except :mod:`celery_redlock.ops`
and the package's lazy top-level names. Importing it absolutely (``import
celery``) always reaches Celery itself, never this folder.

Celery is an extra (``pip install 'celery-redlock[celery]'``): without it,
importing this folder raises one :class:`ImportError` that says so.
"""

from __future__ import annotations

try:
    import celery as _celery  # noqa: F401  # Celery itself, only to learn it is there
except ImportError as exc:
    raise ImportError(
        "celery-redlock's Celery integration (SingletonTask, install, the `celery redlock` "
        "commands) needs Celery: pip install 'celery-redlock[celery]'"
    ) from exc
