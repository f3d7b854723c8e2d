"""Deprecated path of :mod:`celery_redlock.celery.control`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.control", "celery_redlock.celery.control")
