"""One packed command written to a socket, and its reply read, without redis-py's layers.

For :mod:`celery_redlock.core.fanout`, which polls many connections at once,
and for :class:`~celery_redlock.core.lua.Script`, whose two calls per task go
through :func:`exchange`: redis-py's ``send_packed_command()`` and
``read_response()`` poll the socket again and keep per-call bookkeeping that
costs more client CPU than the system calls themselves. Errors are reported
as redis-py reports them. Only redis-py's own TCP, TLS and Unix socket
connections, with a hiredis parser and no health checks, are served here
(:func:`served_directly`); any other connection class goes through redis-py,
because it may change what a read or a write does: a client-side cache's
proxy has no socket of its own, and a Sentinel connection turns a
``READONLY`` reply into a reconnect.
"""

from __future__ import annotations

import errno
import os
import select
import socket
from typing import Any

import redis
from redis._parsers import hiredis as redis_hiredis

__all__ = [
    "INCOMPLETE",
    "NOT_ENOUGH_DATA",
    "PREFETCH_SIZE",
    "exchange",
    "prefetch",
    "readable",
    "ready_reply",
    "send",
    "served_directly",
]

#: Most bytes moved from a readable socket into its reader at once.
PREFETCH_SIZE = 65536
# What a hiredis reader of redis-py returns while a reply is incomplete (False
# before redis-py 5.1 made it a sentinel of its own).
NOT_ENOUGH_DATA = getattr(redis_hiredis, "NOT_ENOUGH_DATA", False)
# select.poll() is missing on Windows: readable() then asks redis-py.
_HAS_POLL = hasattr(select, "poll")

#: :func:`ready_reply`'s answer while a reply is still on its way.
INCOMPLETE = object()

# The connection classes whose reads and writes exchange() reproduces exactly.
# Subclasses are left out on purpose: they override the reading or writing
# (a cache proxy, Sentinel's READONLY handling, a user's instrumentation).
_DIRECT_CLASSES = frozenset(
    {
        redis.connection.Connection,
        redis.connection.SSLConnection,
        redis.connection.UnixDomainSocketConnection,
    }
)


def served_directly(conn: Any) -> bool:
    """Whether :func:`exchange` may talk to ``conn``'s socket itself instead of through redis-py.

    True for a connected redis-py ``Connection``, ``SSLConnection`` or
    ``UnixDomainSocketConnection`` (not a subclass) with a hiredis reader and
    no health checks (redis-py pings before a command once their interval
    has passed).
    """
    return (
        type(conn) in _DIRECT_CLASSES
        and conn._sock is not None
        and not conn.health_check_interval
        and getattr(conn._parser, "_reader", None) is not None
    )


def _talk_error(conn: Any, exc: OSError) -> redis.RedisError:
    """The error redis-py raises for a failed socket call, after closing ``conn``.

    A socket timeout is a ``TimeoutError``: the server may be hung, so a
    script is not sent again. ``ETIMEDOUT`` from the kernel (keepalive or
    ``TCP_USER_TIMEOUT`` declared the peer dead) is a ``ConnectionError``,
    as redis-py 8 has it: the connection is gone, and a script may be resent
    on a new one in the way it declares safe.
    """
    conn.disconnect()
    if isinstance(exc, socket.timeout) and exc.errno != errno.ETIMEDOUT:
        return redis.TimeoutError(f"Timeout talking to {conn._host_error()}")
    return redis.ConnectionError(f"Error talking to {conn._host_error()}: {exc}")


def send(conn: Any, packed: Any) -> int:
    """Write a packed command (a list of chunks, as redis-py packs it) to ``conn``; return its fd.

    A socket with a timeout is non-blocking underneath, and Python polls it
    before every ``send()``; one ``write()`` without that poll nearly always
    takes the whole command, because a command is far smaller than the socket
    buffer. What it does not take goes through redis-py, timeout and all.

    Raises:
        redis.exceptions.ConnectionError: If the socket fails (closed by the server).
    """
    sock = conn._sock
    if sock is None or sock.timeout is None or len(packed) != 1:
        conn.send_packed_command(packed, check_health=False)
        return int(conn._sock.fileno())
    data = packed[0]
    fd: int = sock.fileno()
    try:
        sent = os.write(fd, data)
    except BlockingIOError:
        sent = 0
    except OSError as exc:
        conn.disconnect()
        raise redis.ConnectionError(f"Error {exc.errno} while writing to socket: {exc}") from exc
    if sent < len(data):
        conn.send_packed_command([data[sent:]], check_health=False)
    return fd


def prefetch(conn: Any, fd: int) -> Any:
    """Move what a readable socket holds into ``conn``'s hiredis reader, without a poll.

    The caller's ``poll()`` said the socket is readable, so the extra poll
    Python makes before a ``recv()`` on a socket with a timeout is wasted.
    :func:`ready_reply` then takes whole replies from the reader; the rest of
    an incomplete one is waited for with ``poll()`` again.

    Returns:
        The hiredis reader, or ``None`` for a connection without one (left to
        ``read_response()``).

    Raises:
        redis.exceptions.ConnectionError: If the server closed the connection.
    """
    reader = getattr(conn._parser, "_reader", None)
    sock = conn._sock
    if reader is None or sock is None or sock.timeout is None:
        return None
    try:
        data = os.read(fd, PREFETCH_SIZE)
    except BlockingIOError:
        return reader
    except OSError as exc:
        conn.disconnect()
        raise redis.ConnectionError(f"Error while reading from socket: {exc}") from exc
    if not data:
        conn.disconnect()
        raise redis.ConnectionError("Connection closed by server.")
    reader.feed(data)
    return reader


def ready_reply(conn: Any, reader: Any) -> Any:
    """Return ``conn``'s next reply if it has arrived whole, else :data:`INCOMPLETE`.

    With a hiredis ``reader`` (filled by :func:`prefetch`) the reply is taken
    straight from it, as ``conn.read_response()`` would, without its layers of
    per-call bookkeeping (a third of the client's CPU per reply): error replies
    raise, and a connection-level one (``LOADING``...) closes the connection
    first. Never blocks: the rest of an incomplete reply is waited for with
    ``poll()``, within the round's deadline. Without a reader,
    ``read_response()`` reads it if the socket has data.

    Raises:
        redis.exceptions.ResponseError: For an error reply.
        redis.exceptions.RedisError: If the connection fails.
    """
    if reader is None:
        return conn.read_response() if conn.can_read(0) else INCOMPLETE
    try:
        reply = reader.gets()
    except BaseException:
        # A protocol error leaves the stream unreadable, as redis-py has it.
        conn.disconnect()
        raise
    if reply is NOT_ENOUGH_DATA:
        return INCOMPLETE
    if isinstance(reply, BaseException):
        if isinstance(reply, redis.ConnectionError):
            conn.disconnect()
        raise reply
    return reply


def exchange(conn: Any, packed: bytes) -> Any:
    """Send one packed command on ``conn`` and return its reply, as redis-py would.

    Like ``send_packed_command()`` then ``read_response()`` on a connected
    connection with a hiredis reader, without their bookkeeping: the socket's
    own timeout bounds each system call, a timeout raises ``TimeoutError`` and
    any other socket failure ``ConnectionError``, both after closing the
    connection (the next use reconnects); an error reply is raised (a
    connection-level one, ``LOADING``, after closing), and a RESP3 push
    message read before the reply goes to the parser's handlers. Any other
    connection goes through redis-py.

    Raises:
        redis.exceptions.RedisError: As redis-py raises it.
    """
    if not served_directly(conn):
        conn.send_packed_command([packed])
        return conn.read_response()
    parser, sock = conn._parser, conn._sock
    reader = parser._reader
    buffer = parser._buffer
    try:
        _write_all(sock, packed)
        while True:
            reply = reader.gets()
            while reply is NOT_ENOUGH_DATA:
                read = sock.recv_into(buffer)
                if not read:
                    raise redis.ConnectionError("Connection closed by server.")
                reader.feed(buffer, 0, read)
                reply = reader.gets()
            if type(reply) is int:  # what a task's two scripts answer: nothing to check
                return reply
            push = getattr(parser, "_hiredis_PushNotificationType", None)
            if push is None or not isinstance(reply, push):
                break
            parser.handle_push_response(reply)
        if isinstance(reply, list) and reply and isinstance(reply[0], redis.ConnectionError):
            raise reply[0]
    except OSError as exc:
        raise _talk_error(conn, exc) from exc
    except BaseException:
        # A reply half read, or a protocol error, leaves the stream unusable.
        conn.disconnect()
        raise
    if isinstance(reply, BaseException):
        if isinstance(reply, redis.ConnectionError):
            conn.disconnect()
        raise reply
    return reply


def _write_all(sock: socket.socket, data: bytes) -> None:
    """Write all of ``data`` to ``sock``, bounded by its timeout as ``sendall()`` is.

    Python polls a socket with a timeout before every ``send()``; a command is
    far smaller than the socket buffer, so one ``write()`` without that poll
    nearly always takes it whole: a system call less per command, two per
    task. What it does not take goes through ``sendall()``, timeout and all.
    A TLS socket encrypts in ``sendall()``, so it always goes there.

    Raises:
        OSError: As ``sendall()`` raises it (``socket.timeout`` included).
    """
    if type(sock) is not socket.socket or sock.timeout is None:
        sock.sendall(data)
        return
    try:
        sent = os.write(sock.fileno(), data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def readable(conn: Any) -> bool:
    """Whether ``conn`` has something to read before a command is sent: closed, or owing a reply.

    What redis-py's ``can_read()`` answers; a connection that is not open
    reads as not readable (the next send connects it).

    Raises:
        OSError: If the socket cannot be polled.
    """
    # A TLS socket may hold decrypted bytes above the socket: redis-py knows.
    if not _HAS_POLL or not served_directly(conn) or type(conn._sock) is not socket.socket:
        # Not connected: the next send connects it. (A client-side cache's
        # proxy has no socket of its own and asks the connection it wraps.)
        if getattr(conn, "_sock", True) is None:
            return False
        return bool(conn.can_read())
    sock, reader = conn._sock, conn._parser._reader
    if reader.has_data():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
