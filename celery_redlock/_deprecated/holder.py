"""Deprecated path of :mod:`celery_redlock.core.holder`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.holder", "celery_redlock.core.holder")
