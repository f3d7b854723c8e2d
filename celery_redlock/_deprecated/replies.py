"""Deprecated path of :mod:`celery_redlock.core.replies`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.replies", "celery_redlock.core.replies")
