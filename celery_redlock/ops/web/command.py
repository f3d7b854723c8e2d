"""``celery -A proj redlock web``: serve the dashboard.

Loaded with the ``celery redlock`` commands, so it imports neither Flask nor
prometheus_client until the command runs. It binds ``127.0.0.1`` unless
``--host`` says otherwise, and refuses a non-loopback address on which the
release button would be open to anyone: there, set a token or basic auth, or
add ``--read-only``.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_redlock.core.exceptions import ConfigurationError

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "is_loopback", "web"]

#: Where the dashboard listens unless told otherwise: loopback only.
DEFAULT_HOST = "127.0.0.1"
#: The dashboard's port unless told otherwise.
DEFAULT_PORT = 5566


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _fail(message: str) -> None:
    click.echo(f"celery-redlock: {message}", err=True)
    sys.exit(1)


# long because: one click option per line of the command's signature
@click.command(name="web", cls=CeleryCommand)
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True, help="Port (0: any).")
@click.option("--read-only", is_flag=True, help="Offer no action; refuse every POST.")
@click.option(
    "--refresh",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds between automatic reloads of the lists (0: none).",
)
@click.option("--page-size", type=int, default=50, show_default=True, help="Locks per page.")
@click.option(
    "--timeout",
    # Zero or less would wait for no reply, and read every worker as gone.
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Seconds to wait for workers' replies (ping, stats).",
)
@click.pass_context
def web(
    ctx: click.Context,
    /,
    host: str,
    port: int,
    read_only: bool,
    refresh: float,
    page_size: int,
    timeout: float,
    **kwargs: Any,
) -> None:
    """Serve the lock dashboard (locks, release, stats, /metrics) until interrupted.

    Authentication: a token (setting redlock_web_token or environment variable
    REDLOCK_WEB_TOKEN) or HTTP basic auth as user:password (redlock_web_basic_auth
    or REDLOCK_WEB_BASIC_AUTH).
    """
    app = ctx.obj.app
    try:
        from .app import LOOPBACK_NAMES, create_app
        from .security import auth_from
    except ImportError as exc:
        _fail(f"the dashboard needs the web extra: pip install 'celery-redlock[web]' ({exc})")
    try:
        auth = auth_from(app.conf, os.environ)
    except ConfigurationError as exc:
        _fail(f"configuration error: {exc}")
    loopback = is_loopback(host)
    if not loopback and auth is None and not read_only:
        _fail(
            f"refused to serve actions on {host}, which is reachable from other machines, "
            "without authentication: set redlock_web_token or redlock_web_basic_auth (or "
            "REDLOCK_WEB_TOKEN / REDLOCK_WEB_BASIC_AUTH), or add --read-only"
        )
    # A loopback dashboard answers only to loopback names (no DNS rebinding);
    # one bound elsewhere is reached by whatever name the network gives it.
    hosts = LOOPBACK_NAMES | {host} if loopback else frozenset()
    flask_app = create_app(
        app,
        read_only=read_only,
        auth=auth,
        refresh=refresh,
        page_size=page_size,
        ping_timeout=timeout,
        hosts=hosts,
    )
    _serve(flask_app, host, port)


def _serve(flask_app: Any, host: str, port: int) -> None:
    """Serve ``flask_app`` on ``host:port``, threaded, until interrupted; print its address."""
    from werkzeug.serving import make_server

    server = make_server(host, port, flask_app, threaded=True)
    shown = f"[{host}]" if ":" in host else host
    mode = flask_app.extensions["celery_redlock"].mode
    click.echo(f"celery-redlock dashboard on http://{shown}:{server.port}/ ({mode})")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
