"""The dashboard as a real ``celery ... redlock web`` process, and an HTTP client for it.

:class:`DashboardProcess` starts the command on a free loopback port (``--port
0``; the port is read from the line it prints), and stops it, and only it,
by pid. :class:`Client` keeps cookies (the session, hence the CSRF token)
and never follows redirects, so tests see every status.
"""

from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.celery_harness import REPO_ROOT

__all__ = ["Client", "DashboardProcess", "Reply", "listening_addresses"]

_ANNOUNCE = re.compile(r"dashboard on http://(?P<host>[^/]+):(?P<port>\d+)/")


class DashboardProcess:
    """``celery -A <app_module> redlock web --port 0 <args>`` in a subprocess.

    Args:
        app_module: What ``-A`` gets.
        env: Environment overrides on top of ``os.environ``.
        args: More options of the command.
        log_dir: Where its output goes.
    """

    def __init__(
        self, app_module: str, env: Mapping[str, str], args: Sequence[str], log_dir: Path
    ) -> None:
        self.command = [
            sys.executable, "-m", "celery", "-A", app_module, "redlock", "web", "--port", "0",
            *args,
        ]  # fmt: skip
        self.env = {**os.environ, **env, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"dashboard-{len(list(log_dir.glob('dashboard-*')))}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.port = 0

    def start(self, timeout: float = 30) -> DashboardProcess:
        """Start it and wait for the line naming its address."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command, cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _ANNOUNCE.search(self.log())
            if match:
                self.port = int(match["port"])
                self.url = f"http://127.0.0.1:{self.port}"
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"dashboard exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"dashboard did not start within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        """Everything it printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; by pid."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def __enter__(self) -> DashboardProcess:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


class Reply:
    """An HTTP reply: status, headers and text."""

    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.text = body.decode("utf-8", "replace")

    def csrf_token(self) -> str:
        """The CSRF token of the page's forms."""
        match = re.search(r'name="csrf_token" value="([^"]+)"', self.text)
        assert match, "no CSRF token on the page"
        return match[1]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class Client:
    """Requests to one dashboard, with a cookie jar; redirects are returned, not followed."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()), _NoRedirect()
        )

    def request(
        self,
        path: str,
        *,
        form: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """GET ``path``, or POST ``form`` to it."""
        data = urllib.parse.urlencode(form).encode() if form is not None else None
        request = urllib.request.Request(self.base + path, data=data, headers=dict(headers or {}))
        try:
            with self.opener.open(request, timeout=20) as response:
                return Reply(response.status, response.headers, response.read())
        except urllib.error.HTTPError as error:
            return Reply(error.code, error.headers, error.read())


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port``, from /proc/net/tcp{,6}."""
    found: set[str] = set()
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            address, port_hex = local.rsplit(":", 1)
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            if name == "tcp":
                raw = bytes.fromhex(address)[::-1]
                found.add(".".join(str(b) for b in raw))
            else:
                found.add("::1" if address == "0" * 24 + "01000000" else f"v6:{address}")
    return found
