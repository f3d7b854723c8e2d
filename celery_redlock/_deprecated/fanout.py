"""Deprecated path of :mod:`celery_redlock.core.fanout`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.fanout", "celery_redlock.core.fanout")
