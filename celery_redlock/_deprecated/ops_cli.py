"""Deprecated path of :mod:`celery_redlock.ops.commands`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.ops_cli", "celery_redlock.ops.commands")
