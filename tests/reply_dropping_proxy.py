"""A TCP proxy in front of a Redis server that can lose replies after the server ran the command.

A lost reply is the one connection failure after which the server *did* run
the command: a client cannot tell it from a connection the server closed
before reading it. The proxy reproduces it deterministically: once armed with
:meth:`ReplyDroppingProxy.drop_next_replies`, it receives the server's next
reply (so the command has run), discards it and closes the client's
connection, which the client then reads as "Connection closed by server".
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

__all__ = ["ReplyDroppingProxy"]


class ReplyDroppingProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``, one connection per client."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._guard = threading.Lock()
        self._to_drop = 0
        self.dropped = 0
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="reply-dropping-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        """A redis:// URL that reaches the server through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_next_replies(self, count: int = 1) -> None:
        """Lose the next ``count`` replies the server sends, on whichever connection."""
        with self._guard:
            self._to_drop = count

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._guard:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for source, target, replies in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(
                    target=self._pump, args=(source, target, replies), daemon=True
                ).start()

    def _pump(self, source: socket.socket, target: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if replies and self._take_drop():
                    break
                target.sendall(data)
        except OSError:
            pass
        # Either side ending ends the pair, as a dropped TCP connection would.
        for sock in (source, target):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _take_drop(self) -> bool:
        with self._guard:
            if not self._to_drop:
                return False
            self._to_drop -= 1
            self.dropped += 1
            return True

    def close(self) -> None:
        """Stop accepting and close every forwarded connection."""
        with self._guard:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def __enter__(self) -> ReplyDroppingProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
