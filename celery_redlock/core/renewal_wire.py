"""How one renewal pass goes out: every RENEW call of a pool in one write.

:class:`~celery_redlock.core.renewal.Watchdog` decides which leases a pass
renews and cuts them into chunks (one script call each, at most its batch size,
one hash slot on Cluster); this module sends them:

- on a pooled client, every chunk in one write on one connection, from RESP
  fragments each lease encodes once (:meth:`Lease.renew_resp`);
- on a Redis Cluster client, one cluster pipeline with every call addressed to
  its slot's node: one write per master;
- with ``min_replicas``, ``WAIT`` behind the calls in the same write.

A pass whose calls answer ``NOSCRIPT`` (a restart, a node that never ran the
script) loads the script once and resends those calls in one pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from . import replication as replicated
from .fences import is_cluster
from .lease import Lease
from .lua import Script
from .replication import Replication
from .reserved import checkout

__all__ = ["send_chunks"]

#: The KEYS and ARGV of one chunk's renewal call.
ScriptArgs = Callable[[Sequence[Lease]], tuple[list[str], list[Any]]]


def send_chunks(
    client: Any,
    chunks: Sequence[tuple[Script, Sequence[Lease]]],
    replication: Replication | None = None,
) -> list[Any]:
    """Renew every chunk of leases in one round trip; return each chunk's reply, in order.

    Raises:
        redis.exceptions.RedisError: A connection error or an error reply; the
            caller retries the whole pass's leases.
        ReplicationError: With ``replication``, when too few replicas acknowledged.
    """

    def script_args(chunk: Sequence[Lease]) -> tuple[list[str], list[Any]]:
        args: list[Any] = ["1"]
        extend = args.extend
        for lease in chunk:
            extend((lease.token, int(lease.ttl * 1000)))  # type: ignore[operator]
        return [lease.renew_key for lease in chunk], args

    if replication is None and _packable(client):
        return _send_packed(client, chunks, script_args)
    if replication is None and is_cluster(client):
        return _send_per_node(client, chunks, script_args)
    if len(chunks) == 1 or (replication is not None and is_cluster(client)):
        # One call, or a Cluster whose WAIT must follow each slot's call on
        # that slot's node: sent one by one.
        if replication is None:
            return [script(client, *script_args(chunk)) for script, chunk in chunks]
        return [
            replicated.renew(client, *script_args(chunk), replication, script=script)
            for script, chunk in chunks
        ]
    return _send_pipelined(client, chunks, replication, script_args)


def _send_pipelined(
    client: Any,
    chunks: Sequence[tuple[Script, Sequence[Lease]]],
    replication: Replication | None,
    script_args: ScriptArgs,
) -> list[Any]:
    """Send the chunks in one redis-py pipeline, with ``WAIT`` behind them if replicated."""
    pipe = client.pipeline(transaction=False)
    for script, chunk in chunks:
        _queue(client, pipe, script, *script_args(chunk))
    if replication is not None:
        # Behind every script on the pipeline's one connection: it covers them all.
        pipe.execute_command(*replication.wait)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    acknowledged = replies.pop() if replication is not None else 0
    if replication is None:
        _resend_unknown_scripts(client, chunks, replies, script_args)
    for i, reply in enumerate(replies):
        if isinstance(reply, NoScriptError):
            # Sent apart, on a connection of its own: with its own WAIT.
            script, chunk = chunks[i]
            args = script_args(chunk)
            if replication is None:
                replies[i] = script(client, *args)
            else:
                replies[i] = replicated.renew(client, *args, replication, script=script)
        elif isinstance(reply, Exception):
            raise reply
    if isinstance(acknowledged, Exception):
        raise acknowledged
    if replication is not None:
        renewed = any(any(reply) for reply in replies)
        replicated.check_acknowledged(
            client, int(acknowledged), replication, chunks[0][1][0].name, renewed=renewed
        )
    return replies


def _pack(script: Script, chunk: Sequence[Lease]) -> bytes:
    """The RESP bytes of one renewal call, from the parts each lease encoded once."""
    keys, rest = [], []
    for lease in chunk:
        key, args = lease.renew_resp()
        keys.append(key)
        rest.append(args)
    count = b"%d" % len(chunk)
    return b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$%d\r\n%s\r\n%s$1\r\n1\r\n%s" % (
        3 + 3 * len(chunk) + 1,
        script.sha.encode(),
        len(count),
        count,
        b"".join(keys),
        b"".join(rest),
    )


def _write(pool: Any, packed: Sequence[bytes]) -> Any:
    """Write ``packed`` on a connection of ``pool``; return the connection, owing the replies."""
    connection = checkout(pool)
    try:
        # One buffer: redis-py writes each item of a list with its own syscall.
        connection.send_packed_command([b"".join(packed)])
    except BaseException:
        connection.disconnect()
        pool.release(connection)
        raise
    return connection


def _read(pool: Any, connection: Any, count: int) -> list[Any]:
    """Read ``count`` replies (error replies returned, not raised); release the connection."""
    replies: list[Any] = []
    try:
        for _ in range(count):
            try:
                replies.append(connection.read_response())
            except ResponseError as exc:  # NOSCRIPT among them: the rest still come
                replies.append(exc)
    except BaseException:
        # Replies may be left unread on the socket: never reuse it as it is.
        connection.disconnect()
        raise
    finally:
        pool.release(connection)
    return replies


def _send_packed(
    client: Any, chunks: Sequence[tuple[Script, Sequence[Lease]]], script_args: ScriptArgs
) -> list[Any]:
    """Send every chunk in one write on one pooled connection, then read the replies.

    What a pipeline does, without encoding each lease's key and token
    again on every pass (see :meth:`Lease.renew_resp`): with thousands of
    leases, encoding was most of a pass's CPU.
    """
    packed = [_pack(script, chunk) for script, chunk in chunks]
    pool = client.connection_pool
    replies = _read(pool, _write(pool, packed), len(packed))
    _resend_unknown_scripts(client, chunks, replies, script_args)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _send_per_node(
    client: Any, chunks: Sequence[tuple[Script, Sequence[Lease]]], script_args: ScriptArgs
) -> list[Any]:
    """On a Cluster: each master's calls in one write, all written before any is read.

    Calls that fail (a moved slot, a node that cannot be reached, an unknown
    script) are sent again through a cluster pipeline, which follows
    redirections and refreshes the slot table.
    """
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i, (_, chunk) in enumerate(chunks):
        node = client.get_node_from_key(chunk[0].renew_key)
        by_node.setdefault(node.name, (node, []))[1].append(i)
    replies: list[Any] = [None] * len(chunks)
    written = []
    for node, indices in by_node.values():
        pool = client.get_redis_connection(node).connection_pool
        try:
            connection = _write(pool, [_pack(*chunks[i]) for i in indices])
        except Exception as exc:
            for i in indices:
                replies[i] = exc
            continue
        written.append((pool, connection, indices))
    for pool, connection, indices in written:
        try:
            for i, reply in zip(indices, _read(pool, connection, len(indices))):
                replies[i] = reply
        except Exception as exc:
            for i in indices:
                replies[i] = exc
    _resend_failed(client, chunks, replies, script_args)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _resend_unknown_scripts(
    client: Any,
    chunks: Sequence[tuple[Script, Sequence[Lease]]],
    replies: list[Any],
    script_args: ScriptArgs,
) -> None:
    """Resend the calls a server did not know the script of, with its source, in one pipeline.

    After a restart (or on a Cluster node that never ran it) every call of the
    pass answers ``NOSCRIPT``, having done nothing: sending each again alone
    would cost a round trip per call (per slot, on a Cluster). ``EVAL`` also
    caches the script for the next pass.
    """
    _resend(client, chunks, replies, script_args, NoScriptError)


def _resend_failed(
    client: Any,
    chunks: Sequence[tuple[Script, Sequence[Lease]]],
    replies: list[Any],
    script_args: ScriptArgs,
) -> None:
    """Send every call that failed again, with its script's source, in one cluster pipeline."""
    _resend(client, chunks, replies, script_args, Exception)


def _resend(
    client: Any,
    chunks: Sequence[tuple[Script, Sequence[Lease]]],
    replies: list[Any],
    script_args: ScriptArgs,
    failure: type[Exception],
) -> None:
    """Send the calls whose reply is a ``failure`` again, with their script's source, at once."""
    again = [i for i, reply in enumerate(replies) if isinstance(reply, failure)]
    if not again:
        return
    pipe = client.pipeline(transaction=False)
    for i in again:
        script, chunk = chunks[i]
        _queue(client, pipe, script, *script_args(chunk), source=True)
    for i, reply in zip(again, pipe.execute(raise_on_error=False)):
        replies[i] = reply


def _packable(client: Any) -> bool:
    """Whether renewals to ``client`` may be written to one of its pool's connections."""
    pool = getattr(client, "connection_pool", None)
    return (
        pool is not None
        and getattr(client, "connection", None) is None  # not a single-connection client
        and hasattr(pool, "get_connection")
    )


def _queue(
    client: Any,
    pipe: Any,
    script: Script,
    keys: Sequence[Any],
    args: Sequence[Any],
    *,
    source: bool = False,
) -> None:
    """Queue one renewal call (``source``: as ``EVAL``); on a Cluster, addressed to its node.

    A Cluster pipeline asks a server for the keys of each script call it is not
    told the node of (``COMMAND GETKEYS``): a round trip per call.
    """
    options = {"target_nodes": client.get_node_from_key(keys[0])} if is_cluster(client) else {}
    if source:
        pipe.execute_command("EVAL", script.source, len(keys), *keys, *args, **options)
    else:
        script.queue(pipe, keys, args, **options)
