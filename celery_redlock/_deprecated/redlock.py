"""Deprecated path of :mod:`celery_redlock.core.redlock`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.redlock", "celery_redlock.core.redlock")
