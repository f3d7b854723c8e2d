"""Deprecated path of :mod:`celery_redlock.celery.guard`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.guard", "celery_redlock.celery.guard")
