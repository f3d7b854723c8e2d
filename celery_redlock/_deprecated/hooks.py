"""Deprecated path of :mod:`celery_redlock.celery.hooks`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.hooks", "celery_redlock.celery.hooks")
