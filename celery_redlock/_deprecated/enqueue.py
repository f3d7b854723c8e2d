"""Deprecated path of :mod:`celery_redlock.celery.publish` and :mod:`celery_redlock.celery.window`.

The flat layout's ``enqueue`` module held both sides of the enqueue windows;
its names now live in those two modules and in :mod:`celery_redlock.celery.messages`.
"""

import warnings

from celery_redlock.celery.messages import CONTINUES_HEADER, RESERVATION_HEADER
from celery_redlock.celery.publish import CANVAS_OPTIONS, apply_async, is_canvas, publish_delay
from celery_redlock.celery.window import (
    EnqueueGuard,
    HandoverLock,
    release_revoked,
    reservation_key,
)

__all__ = [
    "CANVAS_OPTIONS",
    "CONTINUES_HEADER",
    "RESERVATION_HEADER",
    "EnqueueGuard",
    "HandoverLock",
    "apply_async",
    "is_canvas",
    "publish_delay",
    "release_revoked",
    "reservation_key",
]

warnings.warn(
    "celery_redlock.enqueue moved to celery_redlock.celery.publish (publish side) and "
    "celery_redlock.celery.window (worker side): import it from there "
    "(the old path goes away in 1.0)",
    DeprecationWarning,
    stacklevel=2,
)
