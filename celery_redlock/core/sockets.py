"""One packed command written to a master's socket, and its reply read, without redis-py's layers.

Internal to :mod:`celery_redlock.core.fanout`, which polls many connections at
once: redis-py's ``send_packed_command()`` and ``read_response()`` poll the
socket again and keep per-call bookkeeping that costs more client CPU than the
system calls themselves. Errors are reported as redis-py reports them.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from redis._parsers import hiredis as redis_hiredis

__all__ = ["INCOMPLETE", "NOT_ENOUGH_DATA", "PREFETCH_SIZE", "prefetch", "ready_reply", "send"]

#: Most bytes moved from a readable socket into its reader at once.
PREFETCH_SIZE = 65536
# What a hiredis reader of redis-py returns while a reply is incomplete (False
# before redis-py 5.1 made it a sentinel of its own).
NOT_ENOUGH_DATA = getattr(redis_hiredis, "NOT_ENOUGH_DATA", False)

#: :func:`ready_reply`'s answer while a reply is still on its way.
INCOMPLETE = object()


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
