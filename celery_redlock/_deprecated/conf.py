"""Deprecated path of :mod:`celery_redlock.calls.options`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.conf", "celery_redlock.calls.options")
