"""Imported by spawned prefork pool processes only: connects their per-queue set-up.

The worker's main process names this module in the app's ``imports`` setting
when its pool spawns its processes (see :mod:`celery_redlock.celery.spawned`). It is
the one module of the package whose import connects a signal handler, because
an import is all a spawned process is given; nothing in the package imports it.
"""

from __future__ import annotations

from .spawned import connect

__all__: list[str] = []

connect()
