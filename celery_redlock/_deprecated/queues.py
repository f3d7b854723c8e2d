"""Deprecated path of :mod:`celery_redlock.celery.queues`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.queues", "celery_redlock.celery.queues")
