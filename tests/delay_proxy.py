"""A loopback TCP proxy that can hold back what clients send, as a slow network would.

Redlock's safety depends on the order in which a master runs commands sent on
different connections; a lost segment's retransmission can deliver one
connection's bytes long after another's. :class:`DelayProxy` stands between
clients and one test server: bytes a client sends while :meth:`hold` is in
force reach the server only at the time given, and each connection's bytes
keep their order (later ones wait behind held ones). Replies pass at once.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from types import TracebackType

from tests.redis_servers import LOOPBACK

__all__ = ["DelayProxy"]


class _Upstream:
    """One client connection's bytes on their way to the server, in order."""

    def __init__(self, server: socket.socket) -> None:
        self.server = server
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.closed = False

    def put(self, due: float, data: bytes) -> None:
        with self.ready:
            self.queue.append((due, data))
            self.ready.notify()

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify()

    def forward(self) -> None:
        while True:
            with self.ready:
                while not self.queue and not self.closed:
                    self.ready.wait()
                if not self.queue:
                    break
                due, data = self.queue.popleft()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                self.server.sendall(data)
            except OSError:
                return
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_WR)


class DelayProxy:
    """Forward connections on :attr:`port` to ``target_port``, holding bytes back on demand.

    Args:
        target_port: The server's port on the loopback interface.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port: int = self._listener.getsockname()[1]
        self._hold_until = 0.0
        self._holding = False
        self._sockets: list[socket.socket] = [self._listener]
        self._guard = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="delay-proxy").start()

    def hold(self, until: float) -> None:
        """Hold back bytes sent from now on until ``until`` (``time.monotonic()`` seconds)."""
        with self._guard:
            self._holding, self._hold_until = True, until

    def stop_holding(self) -> None:
        """Let bytes sent from now on through at once (after any held before them)."""
        with self._guard:
            self._holding = False

    def url(self) -> str:
        """A ``redis://`` URL through the proxy."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    def close(self) -> None:
        """Close every socket of the proxy."""
        with self._guard:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection((LOOPBACK, self.target_port))
            except OSError:
                return
            with self._guard:
                self._sockets += [client, server]
            upstream = _Upstream(server)
            threading.Thread(target=upstream.forward, daemon=True).start()
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _up(self, client: socket.socket, upstream: _Upstream) -> None:
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                upstream.close()
                return
            with self._guard:
                due = self._hold_until if self._holding else 0.0
            upstream.put(due, data)

    def _down(self, server: socket.socket, client: socket.socket) -> None:
        while True:
            try:
                data = server.recv(65536)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_WR)
                return
            try:
                client.sendall(data)
            except OSError:
                return
