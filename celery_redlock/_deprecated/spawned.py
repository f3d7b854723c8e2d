"""Deprecated path of :mod:`celery_redlock.celery.spawned`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.spawned", "celery_redlock.celery.spawned")
