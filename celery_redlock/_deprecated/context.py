"""Deprecated path of :mod:`celery_redlock.calls.context`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.context", "celery_redlock.calls.context")
