"""Deprecated path of :mod:`celery_redlock.celery.added_queues`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.added_queues", "celery_redlock.celery.added_queues")
