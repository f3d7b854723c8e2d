"""Deprecated path of :mod:`celery_redlock.core.recovery`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.recovery", "celery_redlock.core.recovery")
