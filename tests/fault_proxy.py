"""Loopback TCP proxies in front of a test Redis server, for network faults a server cannot fake.

- :class:`DelayProxy` holds back what clients send, as a slow network would.
  Redlock's safety depends on the order in which a master runs commands sent
  on different connections; a lost segment's retransmission can deliver one
  connection's bytes long after another's. Bytes a client sends while
  :meth:`DelayProxy.hold` is in force reach the server only at the time given,
  and each connection's bytes keep their order (later ones wait behind held
  ones). Replies pass at once. ``hold(until, only_open=True)`` holds only the
  connections open at that moment: one connection's bytes arrive late while
  another's, opened after, arrive at once.
- :class:`ReplyDroppingProxy` loses replies after the server ran the command.
  A lost reply is the one connection failure after which the server *did* run
  the command: a client cannot tell it from a connection the server closed
  before reading it. Once armed with :meth:`ReplyDroppingProxy.drop_next_replies`,
  the proxy receives the server's next reply (so the command has run),
  discards it and closes the client's connection, which the client then reads
  as "Connection closed by server".
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from tests.redis_servers import LOOPBACK

__all__ = ["DelayProxy", "ReplyDroppingProxy"]

_ProxyT = TypeVar("_ProxyT", bound="_Proxy")


class _Proxy:
    """Forwards connections on :attr:`port` to ``target_port``, one server connection per client.

    Subclasses say how the bytes of one pair of sockets travel (:meth:`_forward`).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port: int = self._listener.getsockname()[1]
        self._guard = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name=type(self).__name__, daemon=True).start()

    @property
    def url(self) -> str:
        """A ``redis://`` URL that reaches the server through the proxy."""
        return f"redis://{LOOPBACK}:{self.port}/0"

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

    def __enter__(self: _ProxyT) -> _ProxyT:
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
                return  # closed
            with self._guard:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            self._forward(client, server)

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        raise NotImplementedError


def _pump(
    source: socket.socket,
    target: socket.socket,
    keep: Callable[[bytes], bool] | None = None,
) -> None:
    """Copy ``source`` to ``target`` until either ends; ``keep(data)`` False ends it early.

    Either side ending ends the pair, as a dropped TCP connection would.
    """
    try:
        while True:
            data = source.recv(65536)
            if not data or (keep is not None and not keep(data)):
                break
            target.sendall(data)
    except OSError:
        pass
    for sock in (source, target):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class _Upstream:
    """One client connection's bytes on their way to the server, in order, each at its time."""

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


class DelayProxy(_Proxy):
    """A proxy that holds back what clients send on demand (see the module docstring).

    Args:
        target_port: The server's port on the loopback interface.
    """

    def __init__(self, target_port: int) -> None:
        self._hold_until = 0.0
        self._holding = False
        # The connections open now, each by its upstream half.
        self._open: set[_Upstream] = set()
        # The connections a hold applies to (None: all of them).
        self._held: set[_Upstream] | None = None
        super().__init__(target_port)

    def hold(self, until: float, only_open: bool = False) -> None:
        """Hold back bytes sent from now on until ``until`` (``time.monotonic()`` seconds).

        With ``only_open``, only on the connections open now: those opened
        later pass at once.
        """
        with self._guard:
            self._holding, self._hold_until = True, until
            self._held = set(self._open) if only_open else None

    def stop_holding(self) -> None:
        """Let bytes sent from now on through at once (after any held before them)."""
        with self._guard:
            self._holding = False

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        upstream = _Upstream(server)
        with self._guard:
            self._open.add(upstream)
        threading.Thread(target=upstream.forward, daemon=True).start()
        threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
        threading.Thread(target=_pump, args=(server, client), daemon=True).start()

    def _up(self, client: socket.socket, upstream: _Upstream) -> None:
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self._guard:
                    self._open.discard(upstream)
                upstream.close()
                return
            with self._guard:
                held = self._holding and (self._held is None or upstream in self._held)
                due = self._hold_until if held else 0.0
            upstream.put(due, data)


class ReplyDroppingProxy(_Proxy):
    """A proxy that loses the server's next replies on demand (see the module docstring).

    Args:
        target_port: The server's port on the loopback interface.
    """

    def __init__(self, target_port: int) -> None:
        self._to_drop = 0
        self.dropped = 0
        super().__init__(target_port)

    def drop_next_replies(self, count: int = 1) -> None:
        """Lose the next ``count`` replies the server sends, on whichever connection."""
        with self._guard:
            self._to_drop = count

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        threading.Thread(target=_pump, args=(client, server), daemon=True).start()
        threading.Thread(target=_pump, args=(server, client, self._pass), daemon=True).start()

    def _pass(self, reply: bytes) -> bool:
        with self._guard:
            if not self._to_drop:
                return True
            self._to_drop -= 1
            self.dropped += 1
            return False
