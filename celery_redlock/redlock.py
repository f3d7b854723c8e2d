"""Redlock: one lock over N independent Redis masters, held while a majority grants it.

:class:`Redlock` has :class:`~celery_redlock.lock.Lock`'s interface; each
operation goes to every master at once and is decided by a majority (more than
half of the masters):

- acquire: ``SET NX PX`` (with the fence, see below) on every master; held when
  a majority said yes with validity left, ``ttl - elapsed - (ttl * drift + 2 ms)``
  counted from before sending. Otherwise the acquisition is undone on every
  master that granted it or did not answer clearly.
- release / extend / reacquire / renewal: compare-and-delete or
  compare-and-``PEXPIRE`` on every master; a majority must agree.

How requests reach the masters at once: each caller thread writes its command
to one connection per master and waits on all their sockets with ``poll()``,
reading replies in the order they arrive, and returns as soon as the vote is
decided. No thread is involved on this path. A master without an idle
connection is connected from a process-wide thread pool (created on first use
and again after ``fork()``), so a master that hangs while connecting costs the
caller nothing. Replies that come in after the vote was decided are read the
next time their connection is needed, or the connection is closed once its
master has been silent for the node timeout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import random
import select
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.retry import Retry

from .exceptions import (
    ConfigurationError,
    LockError,
    LockNotOwned,
    QuorumNotAchieved,
)
from .lock import Lease, Lock, Number
from .quorum import (
    NOT_ASKED,
    PENDING,
    Holder,
    Votes,
    as_bytes,
    holder_of,
    lost_vote,
    most_common_holder,
    node_address,
    refusal_of_acquire,
)
from .scripts import ACQUIRE, RAISE_FENCE, RELEASE, RENEW, Arg, Script

__all__ = ["Redlock", "RedlockLease", "bounded_client"]

logger = logging.getLogger(__name__)

Master = Union[str, Any]

#: Bounds of the default node timeout, a tenth of the TTL.
NODE_TIMEOUT_MIN = 0.05
NODE_TIMEOUT_MAX = 1.0
#: Idle connections kept per master; more are closed when returned.
MAX_IDLE = 16
#: Background jobs (connects, or commands on clients that cannot be polled) a
#: master may have at once. A hung master thus ties up a few pool threads, and
#: further requests to it fail at once instead of queueing behind them.
MAX_JOBS = 4
#: Most replies a parked connection may owe for a request to be pipelined behind them.
MAX_OWED = 4
#: Threads of the process-wide pool that connects to masters.
POOL_THREADS = 32
#: How often a caller waiting on both sockets and background jobs checks the jobs.
JOB_POLL = 0.001

# -- process-wide state, reset in a forked child -----------------------------------

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_guard = threading.Lock()
# Connections opened before a fork share their sockets with the parent: a child
# must never use them. Nodes compare their generation with this one.
_generation = 0


def _background() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        with _executor_guard:
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(
                    POOL_THREADS, thread_name_prefix="celery-redlock-io"
                )
    return _executor


def _after_fork_in_child() -> None:
    global _executor, _executor_guard, _generation, _registry_guard
    # The parent's pool threads do not exist in the child; shutting the pool down
    # would wait for them. Drop it, and every connection made before the fork.
    # Locks another thread held at the fork would stay held forever: new ones.
    _executor = None
    _executor_guard = threading.Lock()
    _registry_guard = threading.Lock()
    _generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _bounded_kwargs(pool: Any, timeout: float) -> dict[str, Any] | None:
    """Return ``pool``'s connection options with socket timeouts of at most ``timeout``.

    Client-side retries are turned off too: the caller decides what to do after a
    failure, within its own deadline, whereas redis-py's retries would multiply
    the timeout. ``None`` means the pool is of a kind this function does not know
    how to clone (Sentinel, Cluster, ...), so its client has to be used as it is.
    """
    if pool is None or type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return None
    kwargs = {
        key: value
        for key, value in pool.connection_kwargs.items()
        # Per-pool machinery of recent redis-py versions, bound to the original pool.
        if not key.startswith(("maint_notifications", "orig_"))
    }
    for option in ("socket_timeout", "socket_connect_timeout"):
        current = kwargs.get(option)
        kwargs[option] = timeout if current is None else min(current, timeout)
    kwargs["retry"] = Retry(NoBackoff(), 0)
    return kwargs


def bounded_client(client: Any, timeout: float, max_connections: int | None = None) -> Any:
    """Return a client on ``client``'s server with bounded timeouts and no retries.

    The copy has a pool of its own, so it keeps working when the application has
    used up its pool's connections. A client whose pool cannot be cloned
    (Sentinel, Cluster) is returned as it is.
    """
    pool = getattr(client, "connection_pool", None)
    kwargs = _bounded_kwargs(pool, timeout)
    if pool is None or kwargs is None:
        return client
    return redis.Redis(
        connection_pool=redis.ConnectionPool(
            connection_class=pool.connection_class, max_connections=max_connections, **kwargs
        )
    )


def default_node_timeout(ttl: float | None) -> float:
    """A tenth of the TTL, within 50 ms and 1 s, and never more than half the TTL."""
    if ttl is None:
        return NODE_TIMEOUT_MAX
    return min(max(ttl / 10, NODE_TIMEOUT_MIN), NODE_TIMEOUT_MAX, ttl / 2)


def check_node_timeout(node_timeout: object, ttl: float | None) -> float:
    """Validate a Redlock's ``node_timeout`` (``None``: the default for ``ttl``), in seconds.

    Raises:
        ConfigurationError: If it is not a positive number below the TTL.
    """
    if node_timeout is None:
        return default_node_timeout(ttl)
    if isinstance(node_timeout, bool) or not isinstance(node_timeout, (int, float)):
        raise ConfigurationError("node_timeout", node_timeout, "must be a number of seconds")
    if node_timeout <= 0 or (ttl is not None and node_timeout >= ttl):
        raise ConfigurationError(
            "node_timeout", node_timeout, "must be positive and shorter than the timeout"
        )
    return float(node_timeout)


# -- requests ------------------------------------------------------------------------


class _Request:
    """One command for one master: a script call (EVALSHA, EVAL on NOSCRIPT) or plain."""

    __slots__ = ("_packed", "command", "script")

    def __init__(self, command: tuple[Arg, ...], script: Script | None = None) -> None:
        self.command = command
        self.script = script
        self._packed: dict[tuple[tuple[str, str], bool], Any] = {}

    def packed(self, conn: Any, node: _Node) -> Any:
        """Return the command in ``conn``'s wire format: packed once per round, not per master.

        A script goes with its source to a master that has not shown it knows
        the script: a NOSCRIPT that arrives after the vote is decided is never
        read, and the request would be dropped without anyone knowing.
        """
        source = self.script is not None and self.script.sha not in node.scripts
        key = (node.encoding, source)
        found = self._packed.get(key)
        if found is None:
            command = self.with_source() if source else self.command
            found = self._packed[key] = conn.pack_command(*command)
        return found

    @classmethod
    def run(cls, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> _Request:
        return cls(("EVALSHA", script.sha, len(keys), *keys, *args), script)

    @classmethod
    def release(cls, name: str, token: bytes) -> _Request:
        """The compare-and-delete of ``token``, always sent with its source.

        A release must run even when nobody reads its reply (a master that
        answers after the vote was decided), and an unread NOSCRIPT would drop
        it silently. The script is short, so EVAL costs next to nothing more.
        """
        return cls(("EVAL", RELEASE.source, 1, name, token))

    def with_source(self) -> tuple[Arg, ...]:
        """Return the command as EVAL.

        For a master that lost its script cache, or a request nobody will read
        the answer of (so a NOSCRIPT would go unseen).
        """
        if self.script is None:
            return self.command
        return ("EVAL", self.script.source, *self.command[2:])

    def call(self, client: Any) -> Any:
        """Run the request through a redis-py client (for masters that cannot be polled)."""
        try:
            return client.execute_command(*self.command)
        except NoScriptError:
            return client.execute_command(*self.with_source())


class _Connected:
    """A background job's result: a new connection, with nothing sent on it yet."""

    __slots__ = ("conn",)

    def __init__(self, conn: Any) -> None:
        self.conn = conn


# -- masters -------------------------------------------------------------------------


def _pollable(pool: Any, kwargs: dict[str, Any]) -> bool:
    # Plain TCP and unix-socket connections speaking RESP2 without client-side
    # caching: a readable socket then means a whole reply is on its way. TLS can
    # signal readability for records that hold no reply, and RESP3 can carry
    # push messages, so those go through their client on the thread pool.
    cls = pool.connection_class
    return (
        issubclass(cls, (redis.Connection, redis.UnixDomainSocketConnection))
        and not issubclass(cls, redis.SSLConnection)
        and str(kwargs.get("protocol") or 2) == "2"
        and getattr(pool, "cache", None) is None
    )


class _Node:
    """One master: a name for error reports, and the connections used to reach it.

    Connections are private to Redlock, with socket timeouts bounded by the node
    timeout and no client-side retries. An idle connection has nothing left to
    read. A parked one still owes replies to requests nobody waited for; it is
    read when next needed, and closed once it has owed them for the node
    timeout. A reserved parked connection carries an acquire that a lease may
    have to release: the release goes behind it on the same connection (see
    :meth:`claim`), because a master runs one connection's commands in order
    but may interleave two connections' any way.
    """

    def __init__(
        self,
        name: str,
        timeout: float,
        *,
        client: Any = None,
        connection_class: Any = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.timeout = timeout
        # Either a client to run requests through on the thread pool, or what it
        # takes to open pollable connections (replies are parsed here, as bytes).
        self.client = client
        self.pollable = connection_class is not None
        self._connection_class = connection_class
        self._kwargs = {**(kwargs or {}), "decode_responses": False}
        self.encoding = (
            self._kwargs.get("encoding", "utf-8"),
            self._kwargs.get("encoding_errors", "strict"),
        )
        self._reset()

    def _reset(self) -> None:
        self._generation = _generation
        self._guard = threading.Lock()
        # SHAs of the scripts this master has run for us since it last failed;
        # others are sent with their source. (A set: atomic under the GIL.)
        self.scripts: set[str] = set()
        self._idle: list[Any] = []
        # connection -> (replies owed, when to give up on them, reserved)
        self._parked: dict[Any, tuple[int, float, bool]] = {}
        self._jobs = 0

    def checkout(self) -> tuple[Any, int] | None:
        """Return a connection and how many replies it owes before the next one.

        ``None`` means there is no connection at hand: open one with :meth:`start`.
        An idle connection is not probed first (that would cost a system call a
        master and round): a stale one fails, and the round retries on a new one.
        """
        self._after_fork()
        with self._guard:
            if self._idle:
                return self._idle.pop(), 0
            # Pipelining behind replies still on their way beats opening a
            # connection. Connections that have owed replies too long are closed.
            now = time.monotonic()
            found = None
            for conn, (owed, give_up, reserved) in list(self._parked.items()):
                if give_up <= now:
                    del self._parked[conn]
                    conn.disconnect()
                elif found is None and not reserved and owed <= MAX_OWED:
                    del self._parked[conn]
                    found = (conn, owed)
            return found

    def _after_fork(self) -> None:
        # In a forked child the parent's connections are dropped, not closed
        # (closing would shut the parent's sockets down), and the lock, which
        # another thread may have held at the fork, is replaced. The child runs
        # one thread until it starts more, so this check needs no lock.
        if self._generation != _generation:
            self._reset()

    def claim(self, conn: Any) -> int | None:
        """Take back a parked connection; return what it owes, ``None`` if it is gone."""
        self._after_fork()
        with self._guard:
            entry = self._parked.pop(conn, None)
        return None if entry is None else entry[0]

    def checkin(self, conn: Any) -> None:
        """Take back a connection with nothing left to read."""
        with self._guard:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.disconnect()

    def park(
        self, conn: Any, owed: int, give_up: float | None = None, reserved: bool = False
    ) -> None:
        """Keep a connection that still owes ``owed`` replies until ``give_up``."""
        if give_up is None:
            give_up = time.monotonic() + self.timeout
        with self._guard:
            self._parked[conn] = (owed, give_up, reserved)

    def start(self, request: _Request) -> concurrent.futures.Future[Any]:
        """Open a connection from the thread pool, or run ``request`` there through the client.

        The connection comes back unused: the caller sends on it, so a request
        nobody waits for any more is never sent (see :meth:`_Round.finish`).

        Raises:
            redis.exceptions.ConnectionError: If this master already has
                ``MAX_JOBS`` jobs running: it is not answering.
        """
        self._after_fork()
        with self._guard:
            if self._jobs >= MAX_JOBS:
                raise redis.ConnectionError(f"{MAX_JOBS} connection attempts still pending")
            self._jobs += 1
            generation = self._generation
        try:
            job = _background().submit(self._job, request)
        except BaseException:
            self._job_done(generation)
            raise
        job.add_done_callback(lambda _: self._job_done(generation))
        return job

    def _job_done(self, generation: int) -> None:
        with self._guard:
            if generation == self._generation:
                self._jobs -= 1

    def _job(self, request: _Request) -> Any:
        if not self.pollable:
            return request.call(self.client)
        conn = self._connection_class(**self._kwargs)
        conn.connect()
        return _Connected(conn)

    def __repr__(self) -> str:
        return f"<_Node {self.name}>"


_registry_guard = threading.Lock()
# Nodes are shared by every Redlock on the same pool (or URL) and node timeout,
# so short-lived Redlock objects reuse connections. A node keeps no reference to
# the pool, so the weak key can go when the application drops its client.
_nodes: weakref.WeakKeyDictionary[Any, dict[float, _Node]] = weakref.WeakKeyDictionary()
_url_pools: dict[str, Any] = {}


def _node_for(master: Master, timeout: float) -> _Node:
    with _registry_guard:
        if isinstance(master, str):
            pool = _url_pools.get(master)
            if pool is None:
                pool = _url_pools[master] = redis.ConnectionPool.from_url(master)
            client: Any = redis.Redis(connection_pool=pool)
        else:
            client = master
            pool = getattr(master, "connection_pool", None)
        kwargs = _bounded_kwargs(pool, timeout)
        if pool is None or kwargs is None or not _pollable(pool, kwargs):
            # Used through a client on the thread pool; not shared, since such a
            # node has to keep its client alive.
            name = repr(client) if kwargs is None else node_address(kwargs)
            return _Node(name, timeout, client=bounded_client(client, timeout))
        by_timeout = _nodes.setdefault(pool, {})
        node = by_timeout.get(timeout)
        if node is None:
            node = by_timeout[timeout] = _Node(
                node_address(kwargs), timeout, connection_class=pool.connection_class, kwargs=kwargs
            )
        return node


# -- one request to every master -------------------------------------------------------

Settle = Callable[[int, Any], bool]


class _Round:
    """One request sent to every master at once; replies are collected as they arrive.

    :meth:`finish` must follow: it parks the connections whose replies were not
    awaited (see :meth:`_Masters.ask`).

    Args:
        nodes: The masters.
        requests: What to send to each master; ``None`` skips it.
        claims: Reserved connections to send on, by master (see :meth:`_Node.claim`).
    """

    def __init__(
        self,
        nodes: Sequence[_Node],
        requests: Sequence[_Request | None],
        claims: dict[int, Any] | None = None,
    ) -> None:
        self.nodes = nodes
        self.requests = requests
        self.outcomes: list[Any] = [NOT_ASKED if r is None else PENDING for r in requests]
        self.expired = False
        timeout = max((node.timeout for node in nodes), default=0.0)
        self.deadline = time.monotonic() + timeout
        self._poll = select.poll()
        # fd -> (master index, connection, replies to skip before ours, reused)
        self._reading: dict[int, tuple[int, Any, int, bool]] = {}
        self._jobs: dict[concurrent.futures.Future[Any], int] = {}
        self._retried: set[int] = set()
        # Failures met while sending, reported to the first collect().
        self._failed: list[int] = []
        for i, request in enumerate(requests):
            if request is not None:
                self._send(i, request, (claims or {}).get(i))

    def _send(self, i: int, request: _Request, claim: Any) -> None:
        node = self.nodes[i]
        taken = None
        if node.pollable:
            owed = node.claim(claim) if claim is not None else None
            taken = (claim, owed) if owed is not None else node.checkout()
        if taken is None:
            self._start(i)
            return
        conn, skip = taken
        self._write(i, conn, skip, True, request.packed(conn, node))

    def _start(self, i: int) -> None:
        request = self.requests[i]
        assert request is not None
        try:
            self._jobs[self.nodes[i].start(request)] = i
        except RedisError as exc:
            self.outcomes[i] = exc
            self._failed.append(i)

    def _write(self, i: int, conn: Any, skip: int, reused: bool, packed: Any) -> None:
        try:
            conn.send_packed_command(packed, check_health=False)
        except RedisError as exc:  # the connection closed itself
            self.nodes[i].scripts.clear()
            if not self._retry(i, reused, exc):
                self.outcomes[i] = exc
                self._failed.append(i)
            return
        fd = conn._sock.fileno()
        self._reading[fd] = (i, conn, skip, reused)
        self._poll.register(fd, select.POLLIN)

    def _retry(self, i: int, reused: bool, exc: RedisError) -> bool:
        # A connection that sat idle may have been closed by the server (restart,
        # idle timeout): try once more on a new one, as redis-py's pool would.
        if not reused or not isinstance(exc, redis.ConnectionError) or i in self._retried:
            return False
        self._retried.add(i)
        self._start(i)
        return True

    def collect(self, settle: Settle) -> None:
        """Wait for replies, passing each to ``settle(index, reply or error)``.

        Stops once ``settle`` returned ``True``, once every master has answered,
        or at the deadline (the node timeout after sending). Replies that arrived
        together with the deciding one are read too: they cost no wait, and a
        connection left owing them would have to be read later or replaced.
        """
        while self._failed:
            i = self._failed.pop()
            if settle(i, self.outcomes[i]):
                return
        while self._reading or self._jobs:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.expired = True
                return
            if self._reading:
                wait = min(remaining, JOB_POLL) if self._jobs else remaining
                decided = False
                for fd, _ in self._poll.poll(wait * 1000):
                    decided = self._read(fd, settle) or decided
                if decided:
                    return
            else:
                concurrent.futures.wait(self._jobs, remaining, concurrent.futures.FIRST_COMPLETED)
            for job in [job for job in self._jobs if job.done()]:
                if self._take_job(job, settle):
                    return
            while self._failed:
                i = self._failed.pop()
                if settle(i, self.outcomes[i]):
                    return

    def _read(self, fd: int, settle: Settle) -> bool:
        i, conn, skip, reused = self._reading.pop(fd)
        self._poll.unregister(fd)
        node = self.nodes[i]
        request = self.requests[i]
        assert request is not None
        try:
            while skip:
                # Replies to earlier requests on this connection come first.
                try:
                    conn.read_response()
                except NoScriptError:
                    # An earlier script did not run here: resend sources for now.
                    node.scripts.clear()
                except ResponseError:
                    pass
                skip -= 1
                if not conn.can_read(0):
                    self._reading[fd] = (i, conn, skip, reused)
                    self._poll.register(fd, select.POLLIN)
                    return False
            outcome = conn.read_response()
        except NoScriptError:
            node.scripts.clear()
            self._write(i, conn, 0, False, conn.pack_command(*request.with_source()))
            return False
        except ResponseError as exc:
            outcome = exc
        except RedisError as exc:
            # Maybe a restart, which empties the script cache too.
            node.scripts.clear()
            conn.disconnect()
            if self._retry(i, reused, exc):
                return False
            self.outcomes[i] = exc
            return settle(i, exc)
        else:
            if request.script is not None:
                node.scripts.add(request.script.sha)
        node.checkin(conn)
        self.outcomes[i] = outcome
        return settle(i, outcome)

    def _take_job(self, job: concurrent.futures.Future[Any], settle: Settle) -> bool:
        i = self._jobs.pop(job)
        try:
            result = job.result()
        except Exception as exc:
            self.nodes[i].scripts.clear()
            outcome: Any = exc
        else:
            if isinstance(result, _Connected):
                request = self.requests[i]
                assert request is not None
                self._write(i, result.conn, 0, False, request.packed(result.conn, self.nodes[i]))
                return False
            outcome = result
        self.outcomes[i] = outcome
        return settle(i, outcome)

    def finish(self, follow_up: _Request | None = None, reserve: bool = False) -> dict[int, Any]:
        """Stop waiting; park the connections of masters that have not answered.

        Args:
            follow_up: Sent to every master that has not answered, on the
                connection that carries the unanswered request, so the master
                runs it second even if it is hung now and resumes later.
            reserve: Park those connections for the caller, who can
                :meth:`_Node.claim` them later to send something behind them.

        Returns:
            The parked connections, by master index.
        """
        parked: dict[int, Any] = {}
        for i, conn, skip, _ in self._reading.values():
            owed = skip + 1
            if follow_up is not None:
                try:
                    conn.send_packed_command(
                        conn.pack_command(*follow_up.with_source()), check_health=False
                    )
                except RedisError:
                    continue
                owed += 1
            self.nodes[i].park(conn, owed, reserved=reserve)
            parked[i] = conn
        for job, i in self._jobs.items():
            # A connection that comes too late for an acquire stays unused: an
            # acquire sent now could land after the release. Other requests
            # (release, renew) are still worth sending to it.
            late = None if reserve or follow_up is not None else self.requests[i]
            job.add_done_callback(functools.partial(_late, self.nodes[i], late, follow_up))
        self._reading.clear()
        self._jobs.clear()
        return parked


def _late(
    node: _Node,
    request: _Request | None,
    follow_up: _Request | None,
    job: concurrent.futures.Future[Any],
) -> None:
    """Use a background job that finished after its round was over.

    A new connection carries ``request``, if any, or goes idle. A request run
    through a client (a master that cannot be polled) has now run, so its
    ``follow_up`` goes after it.
    """
    try:
        result = job.result()
    except Exception:
        return
    if not isinstance(result, _Connected):
        if follow_up is not None:
            with contextlib.suppress(RedisError):
                node.start(follow_up)
        return
    conn = result.conn
    if request is None:
        node.checkin(conn)
        return
    try:
        conn.send_packed_command(conn.pack_command(*request.with_source()), check_health=False)
    except RedisError:
        return
    node.park(conn, 1)


class _Masters:
    """The masters of one Redlock, asked all at once."""

    __slots__ = ("nodes", "quorum", "timeout")

    def __init__(self, nodes: Sequence[_Node], timeout: float) -> None:
        self.nodes = tuple(nodes)
        self.timeout = timeout
        self.quorum = len(self.nodes) // 2 + 1

    @contextlib.contextmanager
    def ask(
        self, request: _Request | Sequence[_Request | None], claims: dict[int, Any] | None = None
    ) -> Iterator[_Round]:
        """Send ``request`` (or one request per master) to every master at once.

        Leaving the block parks the connections whose replies were not awaited,
        so that they are read before the connection is reused.
        """
        requests = [request] * len(self.nodes) if isinstance(request, _Request) else request
        round_ = _Round(self.nodes, requests, claims)
        try:
            yield round_
        finally:
            round_.finish()

    def vote(
        self,
        request: _Request,
        agrees: Callable[[int, Any], bool],
        claims: dict[int, Any] | None = None,
    ) -> tuple[_Round, Votes]:
        """Send ``request`` to every master and count until a majority is won or lost."""
        votes = Votes(len(self.nodes))
        with self.ask(request, claims) as round_:
            round_.collect(votes.settle(agrees))
        return round_, votes

    def fire(self, request: _Request) -> None:
        """Send ``request`` to every master without waiting for the answers."""
        _Round(self.nodes, [request] * len(self.nodes)).finish()

    def failure(
        self,
        message: str,
        lock_name: str,
        round_: _Round,
        votes: Votes,
        refusal: Callable[[Any], LockError | None],
    ) -> QuorumNotAchieved:
        """Describe a lost vote: what each master that did not agree answered."""
        return lost_vote(
            message,
            lock_name,
            [node.name for node in self.nodes],
            round_.outcomes,
            votes,
            refusal,
            self.timeout,
            round_.expired,
        )


# -- the lock ----------------------------------------------------------------------------


class RedlockLease(Lease):
    """A :class:`Lease` held on a majority of masters; renews itself with a quorum vote.

    The watchdog calls :meth:`renew` for it instead of batching it per
    connection pool.
    """

    renews_itself = True

    __slots__ = ("masters", "stragglers")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The lease's "client" is the set of masters it spans.
        self.masters: _Masters = self.client
        # Connections carrying this lease's acquire to masters that had not
        # answered when the majority was reached; the release goes behind it.
        self.stragglers: dict[int, Any] = {}

    def renew(self) -> None:
        """Set the TTL back to its full length on a majority of masters (the watchdog's hook).

        Raises:
            LockNotOwned: As :meth:`renew_for` does.
            QuorumNotAchieved: As :meth:`renew_for` does.
        """
        assert self.ttl is not None
        self.renew_for(int(self.ttl * 1000), True, "renew")

    def renew_for(self, ms: int, replace: bool, operation: str) -> None:
        """Set (``replace``) or add ``ms`` milliseconds of TTL on a majority of masters.

        The new validity runs from when the request was sent, for the shortest
        TTL among the majority that agreed, minus the drift allowance.

        Raises:
            LockNotOwned: If a majority no longer holds this lease's token; the
                lease is marked lost first.
            QuorumNotAchieved: If too few masters answered, or the majority's
                answer came too late to leave any validity.
        """
        sent_at = self._clock()
        pttls: list[int] = []

        def agrees(i: int, reply: Any) -> bool:
            if reply and int(reply[0]) > 0:
                pttls.append(int(reply[0]))
                return True
            return False

        request = _Request.run(RENEW, (self.name,), ("1" if replace else "0", self.token, ms))
        round_, votes = self.masters.vote(request, agrees)
        if votes.won:
            deadline = self.deadline_for(sent_at, min(pttls) / 1000)
            if deadline > self._clock():
                self.deadline = deadline
                return
            raise QuorumNotAchieved(
                f"Cannot {operation} lock {self.name}: the majority agreed too late to "
                "leave any validity",
                lock_name=self.name,
                granted=votes.granted,
                needed=votes.needed,
            )
        if votes.refused_by_majority:
            self.mark_lost(f"not owned at {operation} on a majority of masters")
            # Masters that still hold our token would keep others out until it expires.
            self.masters.fire(_Request.release(self.name, self.token))
            raise LockNotOwned(
                f"Cannot {operation} a lock that's no longer owned", lock_name=self.name
            )
        raise self.masters.failure(
            f"Cannot {operation} lock {self.name}", self.name, round_, votes, self._refusal
        )

    def _refusal(self, reply: Any) -> LockError | None:
        if reply and int(reply[0]) > 0:
            return None
        return LockNotOwned("this lease's token is not there", lock_name=self.name)


class Redlock(Lock):
    """A lock held on a majority of independent Redis masters (the Redlock algorithm).

    ``Redlock(masters, name, timeout=None, sleep=0.1, blocking=True,
    blocking_timeout=None, thread_local=True, raise_on_release_error=True, *,
    auto_renew=False, on_lost=None, fencing=True, drift_factor=0.01,
    node_timeout=None, watchdog=None, clock=time.monotonic, label=None)``:
    after ``masters`` it takes :class:`~celery_redlock.lock.Lock`'s arguments
    (see there), with these differences:

    - ``sleep`` is the mean pause between attempts while blocking; each pause
      is drawn between half and one and a half of it, so that contenders stop
      splitting the vote;
    - ``clock`` measures validity only: socket waits use ``time.monotonic``;
    - ``fence_key`` names the counter on every master.

    Release, extend and reacquire raise :class:`QuorumNotAchieved` when too few
    masters answer to tell whether the lock is still held. See
    ``docs/redlock.md`` for what the lock and its fence guarantee.

    Args:
        masters: ``redis.Redis`` clients or ``redis://`` URLs, one per independent
            master (not replicas of one another, not one Redis Cluster).
        name: The Redis key of the lock, the same on every master.
        *args: :class:`~celery_redlock.lock.Lock`'s positional arguments after ``name``.
        node_timeout: Longest wait for one master, in seconds; by default a tenth
            of the TTL within 50 ms and 1 s. Must be shorter than the TTL.
        **options: :class:`~celery_redlock.lock.Lock`'s keyword-only arguments.

    Raises:
        ConfigurationError: If an argument is out of range, naming it.
    """

    def __init__(
        self,
        masters: Sequence[Master],
        name: str,
        *args: Any,
        node_timeout: Number | None = None,
        **options: Any,
    ) -> None:
        # Everything but the masters and the node timeout is Lock's, validated there.
        super().__init__(None, name, *args, **options)
        if isinstance(masters, (str, bytes)) or not masters:
            raise ConfigurationError(
                "masters", masters, "must be a non-empty list of clients or URLs"
            )
        self.node_timeout = check_node_timeout(node_timeout, self.timeout)
        nodes = [_node_for(master, self.node_timeout) for master in masters]
        names = Counter(node.name for node in nodes)
        twice = [name for name, count in names.items() if count > 1]
        if twice:
            # Two entries for one server would give it two votes.
            raise ConfigurationError("masters", twice, "name the same server more than once")
        self.masters = tuple(masters)
        self._masters = _Masters(nodes, self.node_timeout)

    @property
    def quorum(self) -> int:
        """How many masters must agree: more than half of them."""
        return self._masters.quorum

    @property
    def nodes(self) -> tuple[str, ...]:
        """The masters' names, as used in :attr:`QuorumNotAchieved.errors`."""
        return tuple(node.name for node in self._masters.nodes)

    # -- hooks of Lock ----------------------------------------------------------------

    def _encode_token(self, token: str | bytes) -> bytes:
        # No client to ask: tokens are sent as UTF-8, redis-py's default encoding.
        return token.encode() if isinstance(token, str) else bytes(token)

    def _retry_delay(self, sleep: Number) -> float:
        # Contenders that all retry after the same pause keep splitting the vote;
        # a random pause lets one of them reach the majority first. (Not a secret:
        # the ``random`` module is fine here.)
        return float(sleep) * random.uniform(0.5, 1.5)

    def _not_acquired(self) -> LockError:
        failure = self.local.failure
        if failure is not None:
            return failure
        return QuorumNotAchieved(
            f"Unable to acquire lock {self.name} within the time specified", lock_name=self.name
        )

    def do_acquire(self, token: bytes) -> bool:
        """Make one attempt on every master; on success store the new lease for this thread."""
        masters = self._masters
        sent_at = self._clock()
        lease = self._new_lease(RedlockLease, masters, token, None, sent_at)
        fences: dict[int, int] = {}
        granted: set[int] = set()
        holders: list[Holder] = []

        def agrees(i: int, reply: Any) -> bool:
            if isinstance(reply, list):  # the acquire script's "held by" answer
                holders.append(holder_of(reply))
                return False
            if reply is None:  # SET NX refused
                return False
            if self.fencing:
                fences[i] = int(reply)
            granted.add(i)
            return True

        votes = Votes(len(masters.nodes))
        with masters.ask(self._grant_request(token)) as grant:
            grant.collect(votes.settle(agrees))
            failure: QuorumNotAchieved | None = None
            if not votes.won:
                failure = masters.failure(
                    f"Lock {self.name} not acquired", self.name, grant, votes, self._refusal
                )
            elif self.fencing:
                lease.fence, failure = self._hand_out_fence(token, fences)
            if failure is None and not lease.valid:
                failure = QuorumNotAchieved(
                    f"Lock {self.name} not acquired: the majority agreed after "
                    f"{(self._clock() - sent_at) * 1000:.1f} ms, leaving no validity "
                    f"of the {self.timeout} s TTL",
                    lock_name=self.name,
                    granted=votes.granted,
                    needed=votes.needed,
                )
            if failure is not None:
                self._undo(grant, granted, token)
            else:
                lease.stragglers = grant.finish(reserve=True)
        self.local.holder = most_common_holder(holders) if holders else None
        if failure is not None:
            failure.holder, failure.holder_ttl = self.local.holder or (None, None)
            self.local.failure = failure
            holder = f" for {self.label}" if self.label else ""
            logger.debug("lock %s not acquired%s: %s", self.name, holder, failure)
            return False
        self.local.failure = None
        self.local.lease = lease
        return True

    def _grant_request(self, token: bytes) -> _Request:
        if self.fencing:
            keys = (self.name, self.fence_key)
            return _Request.run(ACQUIRE, keys, (token, self._ttl_ms, self._fence_retention_ms))
        if self._ttl_ms:
            return _Request(("SET", self.name, token, "NX", "PX", self._ttl_ms))
        return _Request(("SET", self.name, token, "NX"))

    def _refusal(self, reply: Any) -> LockError | None:
        return refusal_of_acquire(self.name, reply)

    def _hand_out_fence(
        self, token: bytes, fences: dict[int, int]
    ) -> tuple[int | None, QuorumNotAchieved | None]:
        """Pick the fence and make sure a majority of masters holds it or more.

        Each master drew its own fence; the largest is handed out. Any later
        acquisition's majority shares a master with the majority that holds this
        fence, where it draws (or raises the counter to) a larger one. Masters
        whose counter this acquisition has just drawn to exactly the fence already
        hold it; usually all do, and no second round trip is needed.
        """
        fence = max(fences.values())
        votes = Votes(len(self._masters.nodes), sum(1 for f in fences.values() if f == fence))
        if votes.won:
            return fence, None
        request = _Request.run(
            RAISE_FENCE, (self.name, self.fence_key), (token, fence, self._fence_retention_ms)
        )
        requests = [None if fences.get(i) == fence else request for i in range(votes.size)]
        with self._masters.ask(requests) as raise_:
            raise_.collect(votes.settle(lambda i, reply: reply == 1))
        if votes.won:
            return fence, None
        return None, self._masters.failure(
            f"Lock {self.name} not acquired: fence {fence} not recorded",
            self.name,
            raise_,
            votes,
            lambda reply: None if reply == 1 else LockError("counter not raised", self.name),
        )

    def _undo(self, grant: _Round, granted: set[int], token: bytes) -> None:
        """Release a failed acquisition on every master that may hold it.

        Masters that have not answered get the release on the same connection,
        right behind the acquire, and are not waited for. Masters that failed
        may have run the acquire before failing, so they get it too, unawaited.
        Masters that refused hold nothing of ours. Only the release on masters
        that said yes is awaited (within the node timeout), so a failed attempt
        leaves no key behind on a master that answered.
        """
        release = _Request.release(self.name, token)
        grant.finish(follow_up=release)
        requests = [
            release if i in granted or isinstance(outcome, BaseException) else None
            for i, outcome in enumerate(grant.outcomes)
        ]
        waiting = set(granted)

        def settle(i: int, outcome: Any) -> bool:
            waiting.discard(i)
            return not waiting

        with self._masters.ask(requests) as undo:
            if waiting:
                undo.collect(settle)

    def do_release(self, expected_token: bytes) -> None:
        """Delete the lock on every master that holds ``expected_token``.

        Raises:
            LockNotOwned: If a majority does not hold the token, or the lease
                was lost or outlived its validity.
            QuorumNotAchieved: If too few masters answered to tell.
        """
        request = _Request.release(self.name, expected_token)
        lease = self.local.lease
        claims: dict[int, Any] = {}
        if isinstance(lease, RedlockLease) and lease.token == expected_token:
            claims, lease.stragglers = lease.stragglers, {}
        round_, votes = self._masters.vote(request, lambda i, reply: reply == 1, claims)
        if votes.won:
            return
        # A lease past its validity is not ours whatever the masters that did
        # not answer might hold: report it lost rather than "cannot tell".
        expired = lease is not None and (
            lease.lost or (lease.deadline is not None and lease.deadline <= self._clock())
        )
        if votes.refused_by_majority or expired:
            if lease is not None:
                lease.lost = True
                lease.loss_reason = lease.loss_reason or "not owned at release"
            raise LockNotOwned("Cannot release a lock that's no longer owned", lock_name=self.name)
        raise self._masters.failure(
            f"Cannot release lock {self.name}",
            self.name,
            round_,
            votes,
            lambda reply: (
                None if reply == 1 else LockNotOwned("the token is not there", lock_name=self.name)
            ),
        )

    def _renew(self, ms: int, replace: bool, operation: str) -> None:
        lease = self.local.lease
        assert isinstance(lease, RedlockLease)
        lease.renew_for(ms, replace, operation)

    def locked(self) -> bool:
        """Return ``True`` if one value is stored under the name on a majority of masters.

        Raises:
            QuorumNotAchieved: If too few masters answered to tell.
        """
        values: Counter[Any] = Counter()
        failed = 0

        def settle(i: int, outcome: Any) -> bool:
            nonlocal failed
            if isinstance(outcome, BaseException):
                failed += 1
            elif outcome is not None:
                values[outcome] += 1
            return bool(values) and max(values.values()) >= self.quorum

        with self._masters.ask(_Request(("GET", self.name))) as round_:
            round_.collect(settle)
        best = max(values.values(), default=0)
        if best >= self.quorum:
            return True
        unanswered = sum(1 for outcome in round_.outcomes if outcome is PENDING)
        if best + failed + unanswered >= self.quorum:
            votes = Votes(len(self._masters.nodes), best)
            raise self._masters.failure(
                f"Cannot tell whether lock {self.name} is held",
                self.name,
                round_,
                votes,
                lambda reply: None,
            )
        return False

    def owned(self) -> bool:
        """Return ``True`` if this thread's token is stored on a majority of masters.

        Raises:
            QuorumNotAchieved: If too few masters answered to tell.
        """
        token = self.local.token
        if token is None:
            return False
        round_, votes = self._masters.vote(
            _Request(("GET", self.name)), lambda i, value: as_bytes(value) == token
        )
        if votes.won or votes.refused_by_majority:
            return votes.won
        raise self._masters.failure(
            f"Cannot tell whether lock {self.name} is owned",
            self.name,
            round_,
            votes,
            lambda value: None if as_bytes(value) == token else LockNotOwned("not ours"),
        )

    def __repr__(self) -> str:
        return (
            f"<Redlock {self.name!r} timeout={self.timeout} "
            f"masters={len(self._masters.nodes)} quorum={self.quorum}>"
        )
