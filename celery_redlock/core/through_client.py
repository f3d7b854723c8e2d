"""Requests to a master reached through its client, a key's unanswered ones kept on one connection.

Internal to :mod:`celery_redlock.core.nodes`, whose jobs on the thread pool run
the requests of masters that cannot be polled (TLS, RESP3, client-side
caching, Sentinel). A master runs one connection's commands in order, but two
connections' in whatever order it reads them. redis-py closes a connection
whose reply did not come within its socket timeout (the node timeout), so the
next request for the key (the undo of an acquire that timed out, a release)
would go on another connection, and a master that resumes after a pause could
run the acquire last: it would hold the key until its TTL.

So a request that writes a key is sent and read here, on a connection of the
client's pool; one whose reply does not come in time keeps its connection,
owing the reply, and the key's next request is written behind it there and
reads the owed replies first, as a thread's lane does on a master that is
polled (see :mod:`~celery_redlock.core.lanes`). The jobs of one key run one
after the other (see :meth:`~celery_redlock.core.nodes.Node.start`), so the
connection is never used by two at once. It goes back to the pool once every
reply it owed is read. It is not closed for owing them while the master may
just be slow: closing a socket with unread data resets the connection, and a
reset may make the master drop a request it has not read yet (such as the
undo behind an acquire). A connection still owing replies :data:`KEEP_FOR`
node timeouts after it was kept is given up (closed), and the key's next
request goes on a new one: its peer may be gone without a reset (a host lost
behind a name that now points elsewhere, a firewall that dropped the
connection), and the master would stay out of every later vote of a
long-lived lock. The follow-up of a late request (its undo, its release:
``Request.behind``) still goes behind it, however long it has been kept.

A request whose connection could not be opened (refused, or its handshake
unanswered) was never written: it raises :class:`NotSent`, and needs no
follow-up, since the master cannot have run it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .reserved import checkout
from .wire import Request

__all__ = ["KEEP_FOR", "NotSent", "ThroughClient", "Unanswered"]

#: Node timeouts a connection owing replies stays kept for its key: as long as
#: the follow-up of a late request is tried for (``late_jobs.FOLLOW_UP_TRIES``).
KEEP_FOR = 5


class Unanswered(RedisTimeoutError):
    """No reply in time to a request sent behind its key's earlier ones, on their connection.

    The master runs it after them whenever it runs them: sending it again
    would not make it run sooner.
    """


class NotSent(RedisConnectionError):
    """A request that failed before any byte of it was written: the master never got it.

    Its connection could not be opened, or it was refused a job slot. It
    cannot have run, so nothing it did needs undoing.
    """


class _Owing:
    """A connection kept for one key: the replies it owes, its socket then, when to give up."""

    __slots__ = ("conn", "give_up", "owed", "sock")

    def __init__(self, conn: Any, owed: int, give_up: float) -> None:
        self.conn = conn
        self.owed = owed
        self.sock = _socket_of(conn)
        self.give_up = give_up


def _skip_reply(conn: Any) -> None:
    """Read a reply nobody waits for: an earlier request's, sent on ``conn`` before."""
    # An error reply is that request's own (a NOSCRIPT: it did not run).
    with contextlib.suppress(ResponseError):
        conn.read_response(disconnect_on_error=False)


def _socket_of(conn: Any) -> Any:
    # A client-side cache's proxy wraps the connection that has the socket.
    return getattr(getattr(conn, "_conn", conn), "_sock", None)


class ThroughClient:
    """Runs one master's requests through its client, keeping unanswered ones' connections by key.

    Args:
        client: The master's client, with bounded timeouts and no retries
            (see :func:`~celery_redlock.core.nodes.bounded_client`).
        node_timeout: The master's node timeout: a connection owing replies
            is kept for its key :data:`KEEP_FOR` times that long, then closed.
    """

    def __init__(self, client: Any, node_timeout: float) -> None:
        self.client = client
        self.keep_for = KEEP_FOR * node_timeout
        self._guard = threading.Lock()
        # key -> its connection owing replies
        self._owing: dict[Any, _Owing] = {}
        pool = getattr(client, "connection_pool", None)
        # A single-connection client owns its connection; a Cluster client has
        # no pool: both go through redis-py, as before.
        pooled = getattr(client, "connection", None) is None and hasattr(pool, "get_connection")
        self._pool = pool if pooled else None

    def run(self, request: Request) -> Any:
        """Run ``request``; behind the replies its key's connection owes, if it has one.

        A read (``GET``) goes through the client: it needs no order, and a
        client-side cache may answer it.

        Raises:
            Unanswered: If its reply did not come within the socket timeout:
                the connection is kept, owing it, for the key's next request.
            NotSent: If no connection could be opened for it: it was never written.
            redis.exceptions.RedisError: What the connection or the master raised.
        """
        key = request.key
        pool = self._pool
        if pool is None or key is None or request.command[0] == "GET":
            return request.call(self.client)
        with self._guard:
            owing = self._owing.pop(key, None)
        if owing is not None:
            conn, owed = owing.conn, self._settle(owing)
            # A follow-up always goes behind: on a new connection, a master
            # that resumes could run the request it follows after it.
            if owed and (request.behind or time.monotonic() < owing.give_up):
                return self._exchange(key, conn, owed, request, owing.give_up)
            if owed:  # owing past keep_for: the master is hung or the peer gone
                self._close(conn)
        try:
            # Opened (and its handshake answered) before the request is written.
            conn = checkout(pool)
        except RedisError as exc:
            raise NotSent(str(exc)) from exc
        return self._exchange(key, conn, 0, request)

    def _exchange(
        self, key: Any, conn: Any, owed: int, request: Request, give_up: float | None = None
    ) -> Any:
        """Send ``request`` on ``conn`` behind ``owed`` replies; read them, then its own.

        ``give_up``: when a connection kept already (owing) stops being kept;
        one kept now is kept :data:`KEEP_FOR` node timeouts.
        """
        pool = self._pool
        assert pool is not None
        try:
            # No health check: its PING would take an owed reply for its own.
            conn.send_command(*request.command, check_health=not owed)
            owed += 1
            while owed > 1:
                _skip_reply(conn)
                owed -= 1
            try:
                reply = conn.read_response(disconnect_on_error=False)
            except NoScriptError:
                conn.send_command(*request.with_source(), check_health=False)
                reply = conn.read_response(disconnect_on_error=False)
        except RedisTimeoutError as exc:
            if owed and _socket_of(conn) is not None:
                if give_up is None:
                    give_up = time.monotonic() + self.keep_for
                kept = _Owing(conn, owed, give_up)
                with self._guard:
                    self._owing[key] = kept
                raise Unanswered(str(exc)) from exc
            self._close(conn)
            raise
        except ResponseError:
            pool.release(conn)
            raise
        except BaseException:
            self._close(conn)
            raise
        pool.release(conn)
        return reply

    def _close(self, conn: Any) -> None:
        """Close ``conn`` (it may owe replies) and hand it back to its pool."""
        assert self._pool is not None
        conn.disconnect()
        self._pool.release(conn)

    def _settle(self, owing: _Owing) -> int:
        """Read the replies ``owing``'s connection has received; return how many it still owes.

        Without waiting: one that owes nothing more goes back to the pool
        (whose check-out tests it again), so a connection the master closed
        meanwhile is not used as it is. One that failed is closed.
        """
        assert self._pool is not None
        conn = owing.conn
        if _socket_of(conn) is not owing.sock:
            owing.owed = 0  # closed, or opened again (its pool was reset): nothing owed
        try:
            while owing.owed and conn.can_read(0):
                _skip_reply(conn)
                owing.owed -= 1
        except RedisTimeoutError:
            pass  # a reply only partly in: still owed, on a connection still sound
        except RedisError:
            conn.disconnect()
            owing.owed = 0
        if not owing.owed:
            self._pool.release(conn)
        return owing.owed
