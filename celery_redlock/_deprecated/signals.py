"""Deprecated path of :mod:`celery_redlock.celery.signals`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.signals", "celery_redlock.celery.signals")
