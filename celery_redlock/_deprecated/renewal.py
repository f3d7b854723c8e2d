"""Deprecated path of :mod:`celery_redlock.core.renewal`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.renewal", "celery_redlock.core.renewal")
