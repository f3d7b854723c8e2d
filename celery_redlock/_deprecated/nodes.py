"""Deprecated path of :mod:`celery_redlock.core.nodes`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.nodes", "celery_redlock.core.nodes")
