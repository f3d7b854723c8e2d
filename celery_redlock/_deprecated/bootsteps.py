"""Deprecated path of :mod:`celery_redlock.celery.bootsteps`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.bootsteps", "celery_redlock.celery.bootsteps")
