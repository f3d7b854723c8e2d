"""Deprecated path of :mod:`celery_redlock.celery.spawn_hook`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.spawn_hook", "celery_redlock.celery.spawn_hook")
