"""Deprecated path of :mod:`celery_redlock.core.inventory`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.inventory", "celery_redlock.core.inventory")
