"""Deprecated path of :mod:`celery_redlock.core.store`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.store", "celery_redlock.core.store")
