"""Deprecated path of :mod:`celery_redlock.celery.task`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.task", "celery_redlock.celery.task")
