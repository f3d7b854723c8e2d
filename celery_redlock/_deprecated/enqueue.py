"""Deprecated path of :mod:`celery_redlock.celery.enqueue`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.enqueue", "celery_redlock.celery.enqueue")
