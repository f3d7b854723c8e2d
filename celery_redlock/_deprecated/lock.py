"""Deprecated path of :mod:`celery_redlock.core.lock`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.lock", "celery_redlock.core.lock")
