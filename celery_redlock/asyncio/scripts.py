"""Running the lock's Lua scripts on a ``redis.asyncio`` client.

The scripts themselves (and their KEYS/ARGV contracts) are the synchronous
package's :mod:`celery_redlock.core.scripts`, run there by
:class:`~celery_redlock.core.lua.Script`; only the transport differs. As there,
the fast path is a single ``EVALSHA`` on a pooled connection; a server that does
not know the script (after ``SCRIPT FLUSH`` or a restart) gets it once with
``EVAL``, which runs and caches it.
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import Coroutine, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_redlock.core.lua import Arg, Script
from celery_redlock.core.through_client import NotSent

__all__ = ["InFlight", "run_script"]


async def _checkout(pool: Any) -> Any:
    try:
        # redis-py >= 5.3 takes no arguments; older versions require the command name.
        try:
            return await pool.get_connection()
        except TypeError:
            return await pool.get_connection("EVALSHA")
    except (RedisConnectionError, RedisTimeoutError) as exc:
        # The pool connects (and shakes hands) before handing a connection out.
        raise NotSent(str(exc)) from exc


class InFlight(Exception):
    """A cancellation that came while the script was on its way to the server.

    Raised by :func:`run_script` with ``hand_over=True`` instead of
    ``CancelledError``: the server may run the script whatever the caller
    does, so the caller must learn what it did before it gives up. ``finish``
    completes the round trip on the same connection (so nothing sent after it
    can overtake it; a script the server did not know is sent in full, as it
    would have been), returns the connection to its pool and returns the reply.
    """

    def __init__(self, finish: Coroutine[Any, Any, Any]) -> None:
        super().__init__("cancelled with a script in flight")
        self.finish = finish


async def run_script(
    script: Script,
    client: Any,
    keys: Sequence[Arg],
    args: Sequence[Arg],
    *,
    hand_over: bool = False,
    patience: float | None = None,
) -> Any:
    """Run ``script`` on ``client`` (a ``redis.asyncio`` client) and return its reply.

    Args:
        script: The script.
        client: A ``redis.asyncio`` client (pooled, single-connection or Cluster).
        keys: Its KEYS.
        args: Its ARGV.
        hand_over: On a cancellation once the script was sent, raise
            :class:`InFlight` instead of dropping the connection and its reply.
            Callers that must know what the script did use it to settle in the
            background only when cancelled, and run inline otherwise.
        patience: Wait this long at least for the reply, whatever the client's
            ``socket_timeout`` (none stays none): see :mod:`.masters` for why.

    Raises:
        InFlight: See ``hand_over``.
        NotSent: If no connection could be opened for it (refused, timed out,
            its handshake failed): never written, the server cannot have run it.
        redis.exceptions.RedisError: Whatever the server or connection raises,
            except ``NOSCRIPT``, which is handled here, and a connection error
            that the script's ``resend`` recovers from.
    """
    pool = getattr(client, "connection_pool", None)
    if pool is None or getattr(client, "connection", None) is not None:
        return await _through_client(script, client, keys, args)
    # Every lock operation comes here: talking to a pooled connection directly
    # skips redis-py's per-command bookkeeping, as the synchronous Script does.
    connection = await _checkout(pool)
    sent = False
    try:
        if script.check_connection:
            await _reconnect_if_closed(connection)
        sent = True
        return await _run_resending(script, connection, keys, args, patience)
    except ResponseError:
        raise  # the server answered: the connection is in a clean state
    except asyncio.CancelledError:
        if not (hand_over and sent):
            await connection.disconnect(nowait=True)
            raise
        finish, connection = _finish(script, connection, pool, keys, args), None
        raise InFlight(finish) from None
    except BaseException:
        # Anything else (a timeout) may leave a reply unread: never hand that
        # connection out again.
        await connection.disconnect(nowait=True)
        raise
    finally:
        if connection is not None:
            await pool.release(connection)


async def _through_client(
    script: Script, client: Any, keys: Sequence[Arg], args: Sequence[Arg]
) -> Any:
    # Single-connection and Cluster clients go through redis-py as they are:
    # their reply is awaited only as long as their socket_timeout, and a
    # failed connect is a plain ConnectionError, not NotSent (docs/asyncio.md).
    try:
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return await client.execute_command("EVAL", script.source, len(keys), *keys, *args)


def _read_timeout(connection: Any, patience: float | None) -> float | None:
    """The reply's timeout for ``read_response``: ``None`` is the connection's own."""
    own: float | None = getattr(connection, "socket_timeout", None)
    if patience is None or own is None:
        return None
    return max(own, patience)


async def _run_resending(
    script: Script,
    connection: Any,
    keys: Sequence[Arg],
    args: Sequence[Arg],
    patience: float | None = None,
) -> Any:
    read_timeout = _read_timeout(connection, patience)
    try:
        return await _run(script, connection, keys, args, read_timeout)
    except RedisConnectionError:
        # A pooled connection the server closed fails on first use: try once
        # more on a fresh one, as the script says is right in case the first
        # send ran and only its reply was lost (see Script). Timeouts are not
        # retried.
        resent_args = script.resend(args)
        if resent_args is None:
            raise
        await connection.disconnect()
        return await _run(script, connection, keys, resent_args, read_timeout)


async def _finish(
    script: Script, connection: Any, pool: Any, keys: Sequence[Arg], args: Sequence[Arg]
) -> Any:
    """Complete the round trip a cancelled :func:`run_script` left on ``connection``."""
    try:
        try:
            return await connection.read_response(disconnect_on_error=False)
        except NoScriptError:
            await connection.send_command("EVAL", script.source, len(keys), *keys, *args)
            return await connection.read_response(disconnect_on_error=False)
    except ResponseError:
        raise
    except BaseException:
        await connection.disconnect(nowait=True)
        raise
    finally:
        await pool.release(connection)


async def _reconnect_if_closed(connection: Any) -> None:
    # See Script.check_connection: the pool's own check is skipped when
    # maintenance notifications are enabled.
    try:
        if await connection.can_read() or _socket_readable(connection):
            raise RedisConnectionError("connection not ready")
    except (RedisConnectionError, OSError):
        await connection.disconnect()
        try:
            await connection.connect()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise NotSent(str(exc)) from exc


def _socket_readable(connection: Any) -> bool:
    """Whether the socket holds what the event loop has not read yet (a server's end of file).

    ``can_read`` sees only what the loop has already read. Polling the socket
    costs one system call; yielding to the loop instead would cost a whole
    pass of it on every lock operation.
    """
    writer = getattr(connection, "_writer", None)
    sock = writer.get_extra_info("socket") if writer is not None else None
    if sock is None:
        return False
    readable, _, _ = select.select([sock.fileno()], [], [], 0)
    return bool(readable)


async def _run(
    script: Script,
    connection: Any,
    keys: Sequence[Arg],
    args: Sequence[Arg],
    read_timeout: float | None = None,
) -> Any:
    # The caller disconnects on errors, and a cancelled read must leave its
    # reply on the connection for _finish.
    await connection.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
    try:
        return await connection.read_response(timeout=read_timeout, disconnect_on_error=False)
    except NoScriptError:
        await connection.send_command("EVAL", script.source, len(keys), *keys, *args)
        return await connection.read_response(timeout=read_timeout, disconnect_on_error=False)
