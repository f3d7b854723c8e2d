"""Who may use the dashboard, and which requests may change anything.

* **Authentication** (optional): a token or HTTP basic auth, from the
  ``redlock_web_token`` / ``redlock_web_basic_auth`` settings or the
  ``REDLOCK_WEB_TOKEN`` / ``REDLOCK_WEB_BASIC_AUTH`` environment variables
  (the environment wins: it belongs to the one process serving the
  dashboard). With either set, every page asks for it, ``/metrics`` included
  (Prometheus sends both kinds). A token is given once on a login page, or on
  each request as ``Authorization: Bearer <token>``.
* **CSRF**: every POST carries the token of the browser's session in a form
  field; a POST without it, or with another one, is refused. The session
  cookie is ``HttpOnly`` and ``SameSite=Strict``.
* **Read-only**: no action is offered and every POST but the login is refused.

Secrets are compared in constant time. This module imports no web framework.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from celery_redlock.core.exceptions import ConfigurationError

__all__ = [
    "BASIC",
    "TOKEN",
    "Auth",
    "auth_from",
    "csrf_token",
    "csrf_valid",
    "mode_line",
]

#: Authentication by a bearer token (``Authorization: Bearer <token>``).
TOKEN = "token"
#: Authentication by HTTP basic auth.
BASIC = "basic"

#: Environment variables that set the dashboard's authentication, over the settings.
TOKEN_ENV = "REDLOCK_WEB_TOKEN"
BASIC_ENV = "REDLOCK_WEB_BASIC_AUTH"

_CSRF_KEY = "csrf"
_LOGIN_KEY = "login"


@dataclass(frozen=True)
class Auth:
    """The dashboard's authentication.

    Attributes:
        kind: :data:`TOKEN` or :data:`BASIC`.
        secret: The token, or ``user:password``.
        source: Where it came from (a setting or an environment variable).
    """

    kind: str
    secret: str
    source: str

    def accepts_header(self, authorization: Any) -> bool:
        """Whether a request's parsed ``Authorization`` header (werkzeug's) passes."""
        if authorization is None:
            return False
        if self.kind == BASIC:
            if authorization.type != "basic":
                return False
            given = f"{authorization.username or ''}:{authorization.password or ''}"
            return hmac.compare_digest(given.encode(), self.secret.encode())
        token = authorization.token if authorization.type == "bearer" else None
        return token is not None and hmac.compare_digest(token.encode(), self.secret.encode())

    def accepts_token(self, token: str) -> bool:
        """Whether ``token``, typed on the login page, is the dashboard's token."""
        return self.kind == TOKEN and hmac.compare_digest(token.encode(), self.secret.encode())

    def login_mark(self) -> str:
        """What a logged-in session stores: changes when the token does, reveals nothing."""
        return hashlib.sha256(b"celery-redlock login:" + self.secret.encode()).hexdigest()

    def logged_in(self, session: Mapping[str, Any]) -> bool:
        """Whether ``session`` logged in with the current token."""
        mark = session.get(_LOGIN_KEY)
        return isinstance(mark, str) and hmac.compare_digest(mark, self.login_mark())

    def log_in(self, session: MutableMapping[str, Any]) -> None:
        """Mark ``session`` as logged in (after :meth:`accepts_token`)."""
        session[_LOGIN_KEY] = self.login_mark()


def auth_from(conf: Mapping[str, Any], environ: Mapping[str, str]) -> Auth | None:
    """Read the dashboard's authentication; ``None`` when none is set.

    Raises:
        ConfigurationError: When both a token and basic auth are set, a value
            is empty, or basic auth lacks the ``user:password`` colon.
    """
    found: list[tuple[str, Any, str]] = []
    for kind, env, setting in (
        (TOKEN, TOKEN_ENV, "redlock_web_token"),
        (BASIC, BASIC_ENV, "redlock_web_basic_auth"),
    ):
        if environ.get(env) is not None:
            found.append((kind, environ[env], env))
        elif conf.get(setting) is not None:
            found.append((kind, conf.get(setting), setting))
    if not found:
        return None
    if len(found) > 1:
        raise ConfigurationError(
            found[1][2], "<hidden>", f"cannot be set together with {found[0][2]}: choose one"
        )
    kind, secret, source = found[0]
    if not isinstance(secret, str) or not secret:
        raise ConfigurationError(source, "<hidden>", "must be a non-empty string")
    if kind == BASIC and ":" not in secret:
        raise ConfigurationError(source, "<hidden>", "must be written user:password")
    return Auth(kind, secret, source)


def csrf_token(session: MutableMapping[str, Any]) -> str:
    """Return the session's CSRF token, making one on first use."""
    token = session.get(_CSRF_KEY)
    if not isinstance(token, str):
        token = session[_CSRF_KEY] = secrets.token_urlsafe(32)
    return token


def csrf_valid(session: Mapping[str, Any], given: str | None) -> bool:
    """Whether a POST's ``given`` token is its session's."""
    expected = session.get(_CSRF_KEY)
    if not isinstance(expected, str) or not isinstance(given, str):
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def mode_line(read_only: bool, auth: Auth | None) -> str:
    """The sentence every page shows: may it change anything, and who may see it."""
    actions = "read-only: no action can be taken" if read_only else "actions enabled"
    if auth is None:
        return f"{actions}; no authentication"
    kind = "a token" if auth.kind == TOKEN else "HTTP basic auth"
    return f"{actions}; protected by {kind} ({auth.source})"
