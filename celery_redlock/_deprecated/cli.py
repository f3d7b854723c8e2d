"""Deprecated path of :mod:`celery_redlock.ops.cli`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.cli", "celery_redlock.ops.cli")
