"""Deprecated path of :mod:`celery_redlock.functions.decorator`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.decorator", "celery_redlock.functions.decorator")
