"""The dashboard's Flask application: its state, and the checks every request passes first.

Before any view runs, a request must come for a host name the dashboard
answers to (so a page of another site, rebound by DNS to the loopback
address, cannot read it), carry the dashboard's authentication when one is
set, and, for a POST, carry the session's CSRF token on a dashboard that is
not read-only. Every response forbids framing and caching and allows no
script. The views are in :mod:`celery_redlock.ops.web.views`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

from flask import Flask, Response, redirect, request, session, url_for
from werkzeug.wrappers import Response as BaseResponse

from . import views
from .dashboard import Dashboard, dashboard
from .security import BASIC, TOKEN, Auth, csrf_token, csrf_valid

__all__ = ["LOOPBACK_NAMES", "create_app"]

#: Host names a loopback dashboard answers to.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})

_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def create_app(
    celery_app: Any,
    *,
    read_only: bool = False,
    auth: Auth | None = None,
    refresh: float = 5.0,
    page_size: int = 50,
    ping_timeout: float = 1.0,
    hosts: Iterable[str] = LOOPBACK_NAMES,
) -> Flask:
    """Build the dashboard of ``celery_app``'s locks.

    Args:
        celery_app: The Celery app (its settings name the lock store).
        read_only: Offer no action and refuse every POST but the login.
        auth: Authentication every request needs (see
            :func:`celery_redlock.ops.web.security.auth_from`).
        refresh: Seconds between automatic reloads of the lists; 0 for none.
        page_size: Locks per page.
        ping_timeout: Seconds to wait for workers' replies.
        hosts: Host names (without port) requests may name; empty for any.
    """
    web = Flask(__name__)
    # Sessions (login, CSRF token) last as long as this process.
    web.secret_key = secrets.token_bytes(32)
    web.config.update(
        SESSION_COOKIE_NAME="celery_redlock",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
    )
    web.extensions["celery_redlock"] = Dashboard(
        celery_app,
        read_only=read_only,
        auth=auth,
        refresh=max(0.0, refresh),
        page_size=max(1, page_size),
        ping_timeout=ping_timeout,
        hosts=frozenset(host.lower() for host in hosts),
    )
    web.before_request(_check_request)
    web.after_request(_secure)
    web.context_processor(_context)
    views.register(web)
    return web


def _refuse(status: int, message: str, **headers: str) -> Response:
    return Response(f"{message}\n", status, {"Content-Type": "text/plain", **headers})


def _host_name(header: str) -> str:
    """The host name of a ``Host`` header, without its port."""
    header = header.lower()
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _authenticated(auth: Auth) -> bool:
    if auth.accepts_header(request.authorization):
        return True
    return auth.kind == TOKEN and auth.logged_in(session)


def _check_request() -> BaseResponse | None:
    dash = dashboard()
    host = _host_name(request.host or "")
    if dash.hosts and host not in dash.hosts:
        return _refuse(400, f"refused: this dashboard does not answer to host {host!r}")
    auth = dash.auth
    if auth is not None and request.endpoint != "login" and not _authenticated(auth):
        if auth.kind == BASIC:
            challenge = 'Basic realm="celery-redlock", charset="UTF-8"'
            return _refuse(401, "authentication required", **{"WWW-Authenticate": challenge})
        if request.method == "POST" or request.endpoint == "metrics":
            bearer = 'Bearer realm="celery-redlock"'
            return _refuse(401, "authentication required", **{"WWW-Authenticate": bearer})
        return redirect(url_for("login", next=request.full_path))
    if request.method == "POST":
        if dash.read_only and request.endpoint != "login":
            return _refuse(403, "refused: the dashboard runs read-only (--read-only)")
        if not csrf_valid(session, request.form.get("csrf_token")):
            return _refuse(
                400, "refused: the form's CSRF token is missing or wrong; reload the page"
            )
    return None


def _secure(response: BaseResponse) -> BaseResponse:
    for name, value in _SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def _context() -> dict[str, Any]:
    dash = dashboard()
    return {
        "mode": dash.mode,
        "read_only": dash.read_only,
        "auth": dash.auth,
        "csrf_token": csrf_token(session),
    }
