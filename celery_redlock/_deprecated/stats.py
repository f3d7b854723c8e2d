"""Deprecated path of :mod:`celery_redlock.celery.stats`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.stats", "celery_redlock.celery.stats")
