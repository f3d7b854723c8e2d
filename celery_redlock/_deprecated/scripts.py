"""Deprecated path of :mod:`celery_redlock.core.scripts`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.scripts", "celery_redlock.core.scripts")
