"""Deprecated path of :mod:`celery_redlock.calls.options` and :mod:`celery_redlock.celery.settings`.

The flat layout's ``conf`` module held both the lock options and Celery's
settings; they now live in those two modules.
"""

import warnings

from celery_redlock.calls.options import (
    CONFLICT_POLICIES,
    DUPLICATE_POLICIES,
    MODES,
    OPTIONS,
    REDIS_ERROR_POLICIES,
    LockOptions,
)
from celery_redlock.celery.settings import (
    PUBLISH_SIDE,
    SETTINGS,
    check_mode_store,
    check_settings,
    flag,
    lock_url,
    parse_queues,
    redact_url,
    resolve,
    validate_settings,
)

__all__ = [
    "CONFLICT_POLICIES",
    "DUPLICATE_POLICIES",
    "MODES",
    "OPTIONS",
    "PUBLISH_SIDE",
    "REDIS_ERROR_POLICIES",
    "SETTINGS",
    "LockOptions",
    "check_mode_store",
    "check_settings",
    "flag",
    "lock_url",
    "parse_queues",
    "redact_url",
    "resolve",
    "validate_settings",
]

warnings.warn(
    "celery_redlock.conf moved to celery_redlock.calls.options (lock options) and "
    "celery_redlock.celery.settings (Celery settings): import it from there "
    "(the old path goes away in 1.0)",
    DeprecationWarning,
    stacklevel=2,
)
