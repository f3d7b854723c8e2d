"""Deprecated path of :mod:`celery_redlock.core.quorum`."""

from celery_redlock._deprecated import alias

alias("celery_redlock.quorum", "celery_redlock.core.quorum")
