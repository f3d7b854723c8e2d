"""The operator dashboard: ``celery -A proj redlock web``.

A small server-rendered Flask application (the ``web`` extra) that lists the
locks in the store, shows one with its holder's state, releases a dead
holder's lock under the rules of ``celery redlock release``, charts the
workers' lock counters and serves them to Prometheus at ``/metrics``.
:func:`create_app` builds it for any WSGI server; the ``web`` command
(:mod:`celery_redlock.ops.web.command`) serves it. Importing this package
imports no web framework: :func:`create_app` loads Flask when called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(celery_app: Any, **options: Any) -> Any:
    """Build the dashboard's Flask application for ``celery_app``.

    Keyword arguments are those of :func:`celery_redlock.ops.web.app.create_app`.

    Raises:
        ImportError: When Flask or prometheus_client is not installed
            (``pip install 'celery-redlock[web]'``).
    """
    from .app import create_app as build

    return build(celery_app, **options)
