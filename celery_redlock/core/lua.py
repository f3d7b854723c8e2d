"""A Lua script, and the one way every script of the lock is run.

Scripts are sent with ``EVALSHA``; when the server does not know a script
(after ``SCRIPT FLUSH`` or a restart) it is sent once with ``EVAL``, which
both runs and caches it, so a flushed script costs one extra round trip, never
a failed operation. After a connection error a script is sent once more in the
way it declares safe in case the first send ran and only its reply was lost
(see :class:`Script`). The scripts themselves are in
:mod:`celery_redlock.core.scripts` and :mod:`celery_redlock.core.window_scripts`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.utils import HIREDIS_AVAILABLE

from .reserved import checkout, reserved_for
from .sockets import exchange, readable

__all__ = ["PACKS_STR_AS_UTF8", "Arg", "Resend", "Script", "bulk"]

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None = None
if HIREDIS_AVAILABLE:
    from hiredis import pack_command as _hiredis_pack

#: Whether a str key or argument is always packed as UTF-8 (hiredis packs), so
#: that a caller may pack a call itself (see :meth:`Script.head`); without
#: hiredis the connection's encoder encodes it.
PACKS_STR_AS_UTF8 = _hiredis_pack is not None

#: One key or argument of a script, as redis-py sends it.
Arg = Union[str, bytes, int, float]
#: How a script is sent again after a connection error: given the ARGV of the
#: first send, the ARGV of the resend, or ``None`` when it must not be resent.
Resend = Callable[[Sequence[Arg]], Optional[Sequence[Arg]]]


def bulk(value: bytes) -> bytes:
    """``value`` as one RESP bulk string, as a packed command carries it."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


def _resend_as_is(args: Sequence[Arg]) -> Sequence[Arg]:
    """The resend of a script that does the same whether it ran once or twice."""
    return args


def _reconnect_if_closed(connection: Any) -> None:
    try:
        # Readable before anything was sent: the server closed the connection
        # (end of file), or it owes a reply nobody read. Either way, start afresh.
        if readable(connection):
            raise RedisConnectionError("connection not ready")
    except (RedisConnectionError, OSError):
        connection.disconnect()
        connection.connect()


class Script:
    """A Lua script identified by its SHA1, run with EVALSHA and an EVAL fallback.

    Unlike redis-py's ``Script`` it is not bound to a client and never issues
    ``SCRIPT EXISTS`` or ``SCRIPT LOAD``: the fast path is exactly one command.

    A connection error is met in two ways that look alike: the server closed
    an idle connection (the command never ran) or it ran the command and the
    reply was lost. The first is common and calls for sending the command
    again; the second makes a plain resend wrong for a script whose second run
    answers differently (a release finds its key gone) or does more (a renewal
    that adds time). So each script declares its ``resend``: given the ARGV of
    the first send, the ARGV to send again with, correct whichever way the
    first send went, or ``None`` when it must not be sent again (the
    ``ConnectionError`` is then raised).
    """

    __slots__ = ("_heads", "check_connection", "name", "resend", "sha", "source")

    def __init__(
        self,
        name: str,
        source: str,
        resend: Resend = _resend_as_is,
        *,
        check_connection: bool = False,
    ) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()
        self.resend = resend
        #: Check the connection before sending, and reconnect if the server
        #: closed it (a restart): for a script whose resend, made although the
        #: first send surely did not run, would answer wrongly (a release would
        #: take a key lost with the dataset for one it deleted) or not be made
        #: at all (a renewal adding time). It costs a system call per call, so
        #: a script whose resend is right either way (an acquire) goes without.
        #: redis-py's pool makes this check on check-out, but not on a reserved
        #: connection, nor with maintenance notifications enabled (redis-py 8's
        #: default).
        self.check_connection = check_connection
        # (keys, keys + args) -> the packed "EVALSHA sha numkeys" of such a call.
        self._heads: dict[tuple[int, int], bytes] = {}

    def __call__(
        self,
        client: Any,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        then: Sequence[Arg] | None = None,
        packed: bytes | None = None,
    ) -> Any:
        """Run the script on ``client`` (a redis-py client) and return its reply.

        ``then`` is a command (``WAIT``) sent in the same write, right behind
        the script on the same connection; the reply is then the pair of both
        replies. It needs a client with a connection pool.

        ``packed``: the ``EVALSHA`` of ``keys`` and ``args`` exactly as this
        script packs it, when the caller built it from parts it keeps (see
        :meth:`head`); a resend or an ``EVAL`` is packed from ``keys`` and ``args``.

        Raises:
            redis.exceptions.RedisError: Whatever the server or connection raises,
                except ``NOSCRIPT``, which is handled here, and a connection
                error that the script's ``resend`` recovers from.
        """
        pool = getattr(client, "connection_pool", None)
        # A single-connection client owns its connection (client.connection);
        # Cluster clients have no pool: both go through redis-py.
        if pool is None or getattr(client, "connection", None) is not None:
            if then is not None:
                raise TypeError(f"{self!r}: a pipelined command needs a pooled client")
            try:
                return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
            except NoScriptError:
                return client.execute_command("EVAL", self.source, len(keys), *keys, *args)
        # The hot path of every task: talk to a pooled connection directly,
        # without redis-py's per-command bookkeeping (about a third of the
        # client's CPU per command).
        reserved = reserved_for(pool)
        if reserved is not None and reserved.busy.acquire(False):  # not blocking
            try:
                connection = reserved.connection
                if connection is None:
                    connection = reserved.connection = checkout(pool)
                return self._exchange(connection, keys, args, then, packed)
            finally:
                reserved.busy.release()
        connection = checkout(pool)
        try:
            return self._exchange(connection, keys, args, then, packed)
        finally:
            pool.release(connection)

    def _exchange(
        self,
        connection: Any,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        then: Any = None,
        packed: bytes | None = None,
    ) -> Any:
        try:
            if self.check_connection:
                _reconnect_if_closed(connection)
            try:
                return self._run(connection, keys, args, then, packed)
            except RedisConnectionError:
                # A connection the server closed (a restart, an idle timeout)
                # fails on first use, often only when the reply is read; like
                # redis-py, try once more on a fresh one, in the way the script
                # says is right if the first send did run. Timeouts are not
                # retried: the server may be hung.
                resent_args = self.resend(args)
                if resent_args is None:
                    raise
                connection.disconnect()
                # Explicitly: a Sentinel connection asks the Sentinels for the
                # current master in connect() only; the lazy connect of the next
                # send would return to the demoted one.
                connection.connect()
                return self._run(connection, keys, resent_args, then)
        except ResponseError:
            raise  # the server answered: the connection is in a clean state
        except BaseException:
            # Anything else may leave a reply unread on the socket: reconnect
            # before the connection is used again.
            connection.disconnect()
            raise

    def _run(
        self,
        connection: Any,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        then: Any = None,
        packed: bytes | None = None,
    ) -> Any:
        if then is not None:
            return self._run_then(connection, keys, args, then)
        if packed is None:
            packed = self._pack(connection, keys, args)
        try:
            return exchange(connection, packed)
        except NoScriptError:
            connection.send_command("EVAL", self.source, len(keys), *keys, *args)
            return connection.read_response()

    def _pack(self, connection: Any, keys: Sequence[Arg], args: Sequence[Arg]) -> bytes:
        """Pack ``EVALSHA`` of this script in RESP, its constant head built once per arity.

        With hiredis, by hiredis as redis-py packs; else by the connection's
        own encoder (bytes as they are): exactly what ``send_command`` sends.
        """
        if _hiredis_pack is not None:
            # What redis-py's own packer does when hiredis is installed.
            try:
                return _hiredis_pack((b"EVALSHA", self.sha, len(keys), *keys, *args))
            except TypeError as exc:
                raise DataError(str(exc)) from exc
        items = (*keys, *args)
        head = self._heads.get((len(keys), len(items)))
        if head is None:
            head = self._heads[(len(keys), len(items))] = self.head(len(keys), len(items))
        parts = [head]
        encoder = connection.encoder
        for item in items:
            value: bytes
            if isinstance(item, bytes):
                value = item
            elif isinstance(item, str):
                value = item.encode(encoder.encoding, encoder.encoding_errors)
            elif isinstance(item, int) and type(item) is int:  # not bool, not an enum
                value = b"%d" % item
            else:  # floats, and the types the encoder refuses
                value = encoder.encode(item)
            parts.append(b"$%d\r\n%s\r\n" % (len(value), value))
        return b"".join(parts)

    def head(self, numkeys: int, items: int) -> bytes:
        """The packed ``EVALSHA sha numkeys`` that starts a call of ``items`` keys and args.

        A call packed as ``head`` then :func:`bulk` of each key and argument,
        str as UTF-8 (when :data:`PACKS_STR_AS_UTF8`), is what :meth:`__call__` packs.
        """
        return b"*%d\r\n$7\r\nEVALSHA\r\n%b%b" % (
            items + 3,
            bulk(self.sha.encode()),
            bulk(b"%d" % numkeys),
        )

    def _run_then(
        self, connection: Any, keys: Sequence[Arg], args: Sequence[Arg], then: Sequence[Arg]
    ) -> tuple[Any, Any]:
        # One write, two replies. Both are read before an error is raised, so
        # the connection owes nothing afterwards.
        for command, script in (("EVALSHA", self.sha), ("EVAL", self.source)):
            packed = connection.pack_commands(
                [(command, script, len(keys), *keys, *args), tuple(then)]
            )
            connection.send_packed_command(packed)
            reply, after = _reply_or_error(connection), _reply_or_error(connection)
            if not isinstance(reply, NoScriptError):
                break
        for value in (reply, after):
            if isinstance(value, ResponseError):
                raise value
        return reply, after

    def send(self, client: Any, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run the script with ``EVAL``, source included, and return its reply.

        For a rare call that must take effect even if its reply is lost: an
        ``EVALSHA`` of a script the server has not cached yet answers
        ``NOSCRIPT`` and does nothing, and a caller that timed out never sends
        the ``EVAL`` fallback.
        """
        return client.execute_command("EVAL", self.source, len(keys), *keys, *args)

    def queue(
        self, pipeline: Any, keys: Sequence[Arg], args: Sequence[Arg], **options: Any
    ) -> None:
        """Queue the script on a pipeline; callers rerun NOSCRIPT replies with ``__call__``.

        ``options`` go to the pipeline's ``execute_command`` (a Cluster
        pipeline's ``target_nodes``).
        """
        pipeline.execute_command("EVALSHA", self.sha, len(keys), *keys, *args, **options)

    def __repr__(self) -> str:
        return f"<Script {self.name} {self.sha[:8]}>"


def _reply_or_error(connection: Any) -> Any:
    try:
        return connection.read_response()
    except ResponseError as exc:
        return exc
