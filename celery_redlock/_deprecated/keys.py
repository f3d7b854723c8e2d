"""Deprecated path of :mod:`celery_redlock.core.keys`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.keys", "celery_redlock.core.keys")
