"""Deprecated path of :mod:`celery_redlock.core.exceptions`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.exceptions", "celery_redlock.core.exceptions")
