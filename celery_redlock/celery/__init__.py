"""The Celery integration: the task class, worker bootsteps, enqueue windows, signals and stats.

It may import :mod:`celery_redlock.core`, :mod:`celery_redlock.calls` and
Celery; nothing outside this folder imports it except :mod:`celery_redlock.ops`
and the package's lazy top-level names. Importing it absolutely (``import
celery``) always reaches Celery itself, never this folder.
"""
