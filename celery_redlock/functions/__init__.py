"""Locks for plain functions and coroutines: the :func:`~celery_redlock.singleton` decorator.

It may import :mod:`celery_redlock.core`, :mod:`celery_redlock.calls` and
:mod:`celery_redlock.asyncio`; it never imports Celery or RQ.
"""
