"""How Redlock reaches one master: the connections it keeps, and the registry that shares them.

Internal to :mod:`celery_redlock.core.redlock`. A :class:`Node` keeps private
connections to one master, with socket timeouts bounded by the node timeout and
no client-side retries: one per thread that uses the master (its
:class:`~celery_redlock.core.lanes.Lane`), and a shared pool of idle and
parked ones. Connections are opened on a process-wide thread pool
(created on first use and again after ``fork()``), so a master that hangs
while connecting costs the caller nothing. The fork hook that resets this
state is registered with the first node, and the registry that shares nodes
between Redlocks keeps a bounded number of them. The commands sent on these
connections are in :mod:`celery_redlock.core.wire`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Union

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .forks import in_forked_children
from .job_slots import JobSlots
from .lanes import Lane, ThreadLane, weak_hand_back
from .through_client import ThroughClient
from .wire import Request

__all__ = ["Connected", "Master", "Node", "bounded_client", "fork_generation", "node_for"]

#: A master as given to Redlock: a ``redis.Redis`` client or a ``redis://`` URL.
Master = Union[str, Any]

#: Idle connections kept per master; more are closed when returned.
MAX_IDLE = 16
#: Background jobs (connects, or commands on clients that cannot be polled) a
#: master may have at once (see :mod:`~celery_redlock.core.job_slots`).
MAX_JOBS = 4
#: Most replies a parked connection may owe for a request to be pipelined behind them.
MAX_OWED = 4
#: Threads of the process-wide pool that connects to masters.
POOL_THREADS = 32
#: Master URLs whose connection pool the registry keeps (least recently used go first).
MAX_URL_POOLS = 64
#: Nodes the registry keeps per pool, one per node timeout (least recently used go first).
MAX_NODES_PER_POOL = 8
# -- process-wide state, reset in a forked child -----------------------------------

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_guard = threading.Lock()
# Connections opened before a fork share their sockets with the parent: a child
# must never use them. Nodes compare their generation with this one.
_generation = 0


def fork_generation() -> int:
    """How many forks this process is away from the one that imported the module.

    State keyed to it (connections, locks) was made before the latest fork when
    its generation is older: a child must drop it, never use it.
    """
    return _generation


def _background() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        in_forked_children(_after_fork_in_child)
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
    own_pool = redis.ConnectionPool(
        connection_class=pool.connection_class, max_connections=max_connections, **kwargs
    )
    copy = redis.Redis(connection_pool=own_pool)
    # Closed when the copy goes, never by the cyclic collector (a RESP3 pool of
    # redis-py 8 is a cycle), whose finalizers run in no set order: a socket
    # finalized before its connection warns "unclosed socket".
    weakref.finalize(copy, own_pool.disconnect)
    return copy


class Connected:
    """A background job's result: a new connection, with nothing sent on it yet."""

    __slots__ = ("conn",)

    def __init__(self, conn: Any) -> None:
        self.conn = conn


# -- masters -------------------------------------------------------------------------


def node_address(kwargs: Mapping[str, Any]) -> str:
    """A master's name in errors: ``host:port/db``, or ``unix://path?db=N``."""
    db = kwargs.get("db", 0)
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={db}"
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"


def server_address(kwargs: Mapping[str, Any]) -> str:
    """The server a master's connections reach, whatever the database: ``host:port`` or a path."""
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


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


class Node:
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
        server: str | None = None,
    ) -> None:
        # Before the first connection: a forked child must drop them all.
        in_forked_children(_after_fork_in_child)
        self.name = name
        # The server itself, without the database: two databases of one server
        # are one master, whose failure takes both.
        self.server = name if server is None else server
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
        # Connection failures met on this master, by any thread (see Lane.epoch).
        self.failures = 0
        self._idle: list[Any] = []
        # Each thread's own connection (see Lane). In a forked child this is
        # replaced with the rest: the parent's lanes are never used there.
        self._lanes = ThreadLane()
        # connection -> (replies owed, when to give up on them, reserved)
        self._parked: dict[Any, tuple[int, float, bool]] = {}
        self.jobs = JobSlots(MAX_JOBS)
        self._through = None if self.client is None else ThroughClient(self.client, self.timeout)

    def checkout(self) -> tuple[Any, int] | None:
        """Return a connection and how many replies it owes before the next one.

        ``None`` means there is no connection at hand: open one with :meth:`start`.
        An idle connection is not probed first (that would cost a system call a
        master and round): a stale one fails, and the round retries on a new one.
        """
        if self._generation != _generation:
            self._reset()
        # The common case, without the lock (list.pop() is atomic): an idle
        # connection comes before any parked one anyway.
        try:
            return self._idle.pop(), 0
        except IndexError:
            if not self._parked:
                return None
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

    def lane(self) -> Lane:
        """This thread's lane to the master, created empty (no connection yet) on first use."""
        self._after_fork()
        lanes = self._lanes
        lane = lanes.lane
        if lane is None:
            lane = lanes.lane = Lane(weak_hand_back(self._hand_back, self._generation))
        return lane

    def _hand_back(self, generation: int, conn: Any, owed: int, give_up: float) -> None:
        # The connection of a lane whose thread ended. A child forked since
        # drops the parent's lanes: their connections are never its to use.
        if generation != _generation or generation != self._generation:
            return
        if owed:
            self.park(conn, owed, give_up)
        else:
            self.checkin(conn)

    def claim(self, conn: Any) -> int | None:
        """Take back a parked connection; return what it owes, ``None`` if it is gone."""
        self._after_fork()
        with self._guard:
            entry = self._parked.pop(conn, None)
        return None if entry is None else entry[0]

    def checkin(self, conn: Any) -> None:
        """Take back a connection with nothing left to read."""
        # Without the lock (list operations are atomic): two threads checking
        # in at once may keep one connection over MAX_IDLE, which is harmless.
        idle = self._idle
        if len(idle) < MAX_IDLE:
            idle.append(conn)
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

    def start(self, request: Request) -> concurrent.futures.Future[Any]:
        """Open a connection from the thread pool, or run ``request`` there through the client.

        The connection comes back unused: the caller sends on it, so a request
        nobody waits for any more is never sent (see :meth:`Round.finish`).

        Through a client, a request for a key starts once the job of the
        previous request for that key has ended (see
        :class:`~celery_redlock.core.job_slots.JobSlots`), and goes on that
        request's connection while its reply is owed (see
        :mod:`~celery_redlock.core.through_client`).

        Raises:
            NotSent: If ``MAX_JOBS`` jobs are running or waiting (the master is
                not answering), unless ``request`` follows one or may wait; or
                if the thread pool takes no more jobs (the interpreter is exiting).
        """
        self._after_fork()
        key = None if self.pollable else request.key
        return self.jobs.start(_background(), self._job, request, key)

    def _job(self, request: Request, previous: concurrent.futures.Future[Any] | None) -> Any:
        if not self.pollable:
            if previous is not None:
                # Submitted earlier to the same (first in, first out) pool, it
                # is running already: this waits at most for its socket timeout.
                concurrent.futures.wait((previous,))
            assert self._through is not None
            return self._through.run(request)
        conn = self._connection_class(**self._kwargs)
        conn.connect()
        return Connected(conn)

    def __repr__(self) -> str:
        return f"<Node {self.name}>"


_registry_guard = threading.Lock()
# Nodes are shared by every Redlock on the same pool (or URL) and node timeout,
# so short-lived Redlock objects reuse connections. A node keeps no reference to
# the pool, so the weak key can go when the application drops its client. A
# node the registry forgets lives on with the Redlocks that use it.
_nodes: weakref.WeakKeyDictionary[Any, OrderedDict[float, Node]] = weakref.WeakKeyDictionary()
# Pools of masters given as URLs: the keys of their nodes, and where their
# connection options come from. Their own connections are never used.
_url_pools: OrderedDict[str, Any] = OrderedDict()


def _url_pool(url: str) -> Any:
    pool = _url_pools.get(url)
    if pool is None:
        pool = _url_pools[url] = redis.ConnectionPool.from_url(url)
        if len(_url_pools) > MAX_URL_POOLS:
            _, evicted = _url_pools.popitem(last=False)
            evicted.disconnect()
    else:
        _url_pools.move_to_end(url)
    return pool


def node_for(master: Master, timeout: float) -> Node:
    """Return the node of ``master`` (a client or URL) for this node timeout.

    Clients whose connections can be polled share one node per pool; others get
    a node of their own that runs requests through the client on the thread pool.
    """
    # Before taking the registry's lock: a child forked while another thread
    # holds it gets a new one.
    in_forked_children(_after_fork_in_child)
    with _registry_guard:
        if isinstance(master, str):
            pool = _url_pool(master)
            client: Any = redis.Redis(connection_pool=pool)
        else:
            client = master
            pool = getattr(master, "connection_pool", None)
        kwargs = _bounded_kwargs(pool, timeout)
        if pool is None or kwargs is None or not _pollable(pool, kwargs):
            # Used through a client on the thread pool; not shared, since such a
            # node has to keep its client alive.
            if kwargs is None:
                name = server = repr(client)
            else:
                name, server = node_address(kwargs), server_address(kwargs)
            return Node(name, timeout, client=bounded_client(client, timeout), server=server)
        by_timeout = _nodes.get(pool)
        if by_timeout is None:
            by_timeout = _nodes[pool] = OrderedDict()
        node = by_timeout.get(timeout)
        if node is None:
            node = by_timeout[timeout] = Node(
                node_address(kwargs),
                timeout,
                connection_class=pool.connection_class,
                kwargs=kwargs,
                server=server_address(kwargs),
            )
            if len(by_timeout) > MAX_NODES_PER_POOL:
                by_timeout.popitem(last=False)
        else:
            by_timeout.move_to_end(timeout)
        return node
