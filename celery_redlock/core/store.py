"""The lock store: which Redis topology a setting names, its clients, and the locks made on it.

``redlock_url`` (or, when it is unset, a Redis broker URL) names one of four
topologies:

==========  ==========================================================  ==========
topology    written as                                                  lock
==========  ==========================================================  ==========
redis       ``redis://``, ``rediss://`` or ``unix://`` URL               ``Lock``
redlock     a list of such URLs, one per independent master             ``Redlock``
cluster     ``redis+cluster://host:port[;redis+cluster://host:port]``   ``Lock``
sentinel    ``sentinel://host:port[;sentinel://host:port]`` and          ``Lock``
            ``master_name`` in ``redlock_transport_options``
==========  ==========================================================  ==========

The Sentinel form is kombu's (``broker_url`` plus ``broker_transport_options``),
so a Sentinel broker can also serve as the lock store. kombu's unix-socket
forms ``redis+socket:///path`` and ``socket:///path`` (database in
``?virtual_host=N``) are read as ``unix:///path?db=N``. ``rediss+cluster://``
is the TLS form of the Cluster URL. Parsing does no I/O, so a bad setting is
reported when the worker starts (see :mod:`celery_redlock.core.store_setting`);
clients are built on first use. ``redlock_min_replicas`` and
``redlock_replica_timeout`` say how many replicas confirm each lock made here
(see :mod:`celery_redlock.core.replication`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.sentinel import Sentinel

from .admission import admission_lock
from .exceptions import ConfigurationError
from .lock import Lock
from .permit import check_limit
from .redlock import Redlock
from .replica_settings import AUTO, auto_replicas
from .scripts import RELEASE_HELD_BY
from .semaphore import Semaphore
from .semaphore_scripts import RELEASE_PERMITS_HELD_BY, semaphore_keys
from .store_setting import (
    CLUSTER_SCHEMES,
    DEFAULT_PORTS,
    REDIS_SCHEMES,
    SENTINEL_SCHEME,
    SOCKET_SCHEMES,
    TOPOLOGIES,
    StoreSpec,
    parse_store,
    redact_url,
    scheme_of,
)

# Parsing the setting lives in store_setting.py; its names stay importable
# from here, where the API reference shows them.
__all__ = [
    "CLUSTER_SCHEMES",
    "REDIS_SCHEMES",
    "SENTINEL_SCHEME",
    "SOCKET_SCHEMES",
    "TOPOLOGIES",
    "LockStore",
    "StoreSpec",
    "parse_store",
    "redact_url",
    "store_for",
]

#: Socket timeouts of the store's clients, unless a URL says otherwise. They
#: bound how long a run waits on a broken Redis before its on_redis_error
#: policy takes over.
SOCKET_TIMEOUT = 5.0


class LockStore:
    """The clients of one lock store, and the locks made on it.

    Clients are built on first use and kept for the life of the store, so
    every lock of a process shares their connection pools (and, for Redlock,
    the fan-out's connections).

    Args:
        spec: The parsed setting (see :func:`parse_store`).
    """

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self._client: Any = None
        self._min_replicas: int | None = None
        self._guard = threading.Lock()

    @property
    def client(self) -> Any:
        """The client locks are made with: one per master for Redlock (a list), else one.

        Raises:
            redis.exceptions.ConnectionError: When a Redis Cluster cannot be
                reached to learn its slots (redis-py connects while building
                a Cluster client).
        """
        if self._client is None:
            with self._guard:
                if self._client is None:
                    self._client = self._build()
        return self._client

    def _build(self) -> Any:
        spec, timeouts = self.spec, {"socket_timeout": SOCKET_TIMEOUT}
        timeouts["socket_connect_timeout"] = SOCKET_TIMEOUT
        if spec.topology == "redis":
            # The URL's own query (socket_timeout=...) wins over these defaults.
            return redis.Redis.from_url(spec.urls[0], **timeouts)
        if spec.topology == "redlock":
            return [redis.Redis.from_url(url, **timeouts) for url in spec.urls]
        if spec.topology == "cluster":
            return _cluster_client(spec.urls, timeouts)
        return _sentinel_client(spec, timeouts)

    def lock(self, name: str, *, limit: int = 1, **kwargs: Any) -> Lock | Semaphore:
        """Return a lock on key ``name``: a :class:`Redlock` over a list of masters, else a Lock.

        With ``limit`` above 1, a :class:`Semaphore` of that many permits (see
        :func:`~celery_redlock.core.admission.admission_lock`). Keyword
        arguments are :class:`~celery_redlock.core.lock.Lock`'s.

        Raises:
            ConfigurationError: For a ``limit`` above 1 on Redlock masters:
                the semaphore runs on one Redis, Sentinel or Cluster.
            redis.exceptions.RedisError: When building the client needs a
                server that does not answer (Redis Cluster only), or the first
                lock of an ``"auto"`` ``redlock_min_replicas`` asks the
                topology (Sentinel, Cluster) and it does not answer.
        """
        if self.spec.topology == "redlock":
            if check_limit("limit", limit) != 1:
                raise ConfigurationError(
                    "limit",
                    limit,
                    "needs a lock store on one Redis, Sentinel or Cluster; redlock_url lists "
                    "several masters (Redlock), where a semaphore has no quorum version",
                )
            return Redlock(self.client, name, **kwargs)
        if limit != 1 or type(limit) is not int:
            # Permits are not confirmed on replicas (yet): see docs/limits.md.
            return admission_lock(self.client, name, limit=limit, **kwargs)
        kwargs.setdefault("min_replicas", self.min_replicas())
        if self.spec.replica_timeout is not None:
            kwargs.setdefault("replica_timeout", self.spec.replica_timeout)
        return Lock(self.client, name, **kwargs)

    def min_replicas(self) -> int:
        """How many replicas confirm each lock made here; ``"auto"`` asks the topology once.

        Raises:
            redis.exceptions.RedisError: When ``"auto"`` needs the topology and
                it cannot be asked (the next call asks again).
        """
        if self._min_replicas is None:
            value = self.spec.min_replicas
            if value == AUTO:
                value = auto_replicas(self.spec.topology, self.client)
            assert isinstance(value, int)
            self._min_replicas = value
        return self._min_replicas

    def masters(self) -> list[Any]:
        """One plain client per master that holds locks, for health checks.

        Raises:
            redis.exceptions.RedisError: When the topology cannot be discovered.
        """
        client = self.client
        if self.spec.topology == "redlock":
            return list(client)
        if self.spec.topology == "cluster":
            return [node.redis_connection for node in client.get_primaries()]
        return [client]

    def release_held_by(self, name: str, fragment: str, *, limit: int = 1) -> int:
        """Delete lock ``name`` where its value holds ``fragment``; return how many masters did.

        Used to free the lock of a holder known dead (see ``hooks.py``). On
        Redlock every master is asked; one that fails is left to the TTL. With
        ``limit`` above 1 ``name`` is a semaphore: the permits naming the
        holder are removed, and their count returned.

        Raises:
            redis.exceptions.RedisError: When no master could be asked.
        """
        if limit > 1 and self.spec.topology != "redlock":
            keys = semaphore_keys(name)
            args = (fragment, 60_000)
            return int(
                RELEASE_PERMITS_HELD_BY(self.client, (keys.permits, keys.waiters, keys.wake), args)
            )
        clients = self.client if self.spec.topology == "redlock" else [self.client]
        released, errors = 0, []
        for client in clients:
            try:
                released += int(RELEASE_HELD_BY(client, (name,), (fragment,)))
            except RedisError as exc:
                errors.append(exc)
        if errors and len(errors) == len(clients):
            raise errors[0]
        return released

    def close(self) -> None:
        """Close the store's connections; the next use opens new ones."""
        with self._guard:
            client, self._client = self._client, None
        for one in client if isinstance(client, list) else [client] if client else []:
            one.close()

    def __repr__(self) -> str:
        return f"<LockStore {self.spec.topology}: {self.spec.describe()}>"


def _node_kwargs(url: str, default_port: int) -> tuple[str, int, dict[str, Any]]:
    """Host, port and connection options of a ``scheme://[user:password@]host:port`` URL."""
    parts = urlsplit(url)
    kwargs: dict[str, Any] = {}
    if parts.username:
        kwargs["username"] = unquote(parts.username)
    if parts.password:
        kwargs["password"] = unquote(parts.password)
    path = unquote(parts.path).strip("/")
    if path:
        kwargs["db"] = int(path)
    assert parts.hostname is not None  # checked by parse_store
    return parts.hostname, parts.port or default_port, kwargs


def _cluster_client(urls: Sequence[str], timeouts: Mapping[str, float]) -> Any:
    nodes = []
    options: dict[str, Any] = dict(timeouts)
    for url in urls:
        host, port, kwargs = _node_kwargs(url, DEFAULT_PORTS["cluster"])
        kwargs.pop("db", None)  # only 0 gets past parse_store
        nodes.append(ClusterNode(host, port))  # type: ignore[no-untyped-call]
        options.update(kwargs)
    if scheme_of(urls[0]) == "rediss+cluster":
        options["ssl"] = True
    try:
        return RedisCluster(startup_nodes=nodes, **options)
    except RedisClusterException as exc:
        # Not a RedisError: callers' Redis error policies would not see it.
        raise RedisConnectionError(f"Redis Cluster unreachable: {exc}") from exc


def _sentinel_client(spec: StoreSpec, timeouts: Mapping[str, float]) -> Any:
    sentinels = []
    master: dict[str, Any] = dict(timeouts)
    for url in spec.urls:
        host, port, kwargs = _node_kwargs(url, DEFAULT_PORTS["sentinel"])
        sentinels.append((host, port))
        # As in kombu: credentials and database in the URL are the master's.
        master.update(kwargs)
    sentinel_kwargs = dict(spec.options.get("sentinel_kwargs") or {})
    for option, seconds in timeouts.items():
        sentinel_kwargs.setdefault(option, seconds)
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8.2
        sentinels,
        min_other_sentinels=spec.options.get("min_other_sentinels", 0),
        sentinel_kwargs=sentinel_kwargs,
    )
    return sentinel.master_for(spec.options["master_name"], **master)  # type: ignore[no-untyped-call, unused-ignore]


_stores: weakref.WeakKeyDictionary[Any, LockStore] = weakref.WeakKeyDictionary()


def store_for(app: Any) -> LockStore:
    """Return this process's lock store of Celery app ``app``, built on first use.

    A store is rebuilt when the app's setting changes.

    Raises:
        ConfigurationError: When the setting is bad.
    """
    spec = parse_store(app.conf)
    store = _stores.get(app)
    if store is None or store.spec != spec:
        store = _stores[app] = LockStore(spec)
    return store
