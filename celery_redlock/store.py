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
so a Sentinel broker can also serve as the lock store. ``redlock_min_replicas``
and ``redlock_replica_timeout`` say how many replicas confirm each lock (see
:mod:`celery_redlock.replication`). kombu's unix-socket
forms ``redis+socket:///path`` and ``socket:///path`` (database in
``?virtual_host=N``) are read as ``unix:///path?db=N``. ``rediss+cluster://``
is the TLS form of the Cluster URL. Parsing does no I/O, so a bad setting is
reported when the worker starts; clients are built on first use.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.sentinel import Sentinel

from .exceptions import ConfigurationError
from .lock import Lock
from .redlock import Redlock
from .replica_settings import AUTO, MinReplicas, auto_replicas, replication_settings
from .scripts import RELEASE_HELD_BY

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

#: Schemes of one plain Redis server (redis-py's).
REDIS_SCHEMES = ("redis", "rediss", "unix")
#: kombu's schemes of one Redis server on a unix socket, read as ``unix://``.
SOCKET_SCHEMES = ("redis+socket", "socket")
#: Schemes of a Redis Cluster startup node (plain and TLS).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: Scheme of one Sentinel (kombu's).
SENTINEL_SCHEME = "sentinel"
#: Every topology a lock store can have.
TOPOLOGIES = ("redis", "redlock", "cluster", "sentinel")

#: The setting naming the lock store.
URL_SETTING = "redlock_url"
#: Options of a Sentinel lock store (``master_name``, ...), as kombu's transport options.
OPTIONS_SETTING = "redlock_transport_options"

_DEFAULT_PORTS = {"redis": 6379, "cluster": 6379, "sentinel": 26379}
#: Sentinel transport options this module reads; kombu's names.
_SENTINEL_OPTIONS = ("master_name", "min_other_sentinels", "sentinel_kwargs")

#: Socket timeouts of the store's clients, unless a URL says otherwise. They
#: bound how long a run waits on a broken Redis before its on_redis_error
#: policy takes over.
SOCKET_TIMEOUT = 5.0


@dataclass(frozen=True)
class StoreSpec:
    """A parsed lock store setting; parsing does no I/O.

    Attributes:
        topology: One of :data:`TOPOLOGIES`.
        urls: The URLs, one per master (redlock), startup node (cluster),
            Sentinel (sentinel), or the one server (redis).
        setting: The setting the URLs came from, for messages.
        options: Sentinel options (``master_name``, ``min_other_sentinels``,
            ``sentinel_kwargs``); empty for the other topologies.
        min_replicas: Replicas that must confirm each lock, or ``"auto"``
            (decided by the topology on first use: see :func:`auto_replicas`).
        replica_timeout: Longest wait for them in seconds; ``None``: the lock's default.
    """

    topology: str
    urls: tuple[str, ...]
    setting: str = URL_SETTING
    options: Mapping[str, Any] = field(default_factory=dict)
    min_replicas: MinReplicas = AUTO
    replica_timeout: float | None = None

    def describe(self) -> str:
        """A one-line description without passwords, for messages and logs."""
        urls = ", ".join(redact_url(url) for url in self.urls)
        if self.topology == "redis":
            return urls
        if self.topology == "sentinel":
            return f"sentinel master {self.options['master_name']!r} via {urls}"
        if self.topology == "cluster":
            return f"Redis Cluster via {urls}"
        return f"Redlock over {len(self.urls)} masters ({urls})"


def parse_store(conf: Mapping[str, Any]) -> StoreSpec:
    """Read the lock store from ``redlock_url``, else from a Redis or Sentinel broker URL.

    Raises:
        ConfigurationError: Naming ``redlock_url`` (or the options setting) and
            the bad value, when neither gives a usable lock store; or naming
            ``redlock_min_replicas`` or ``redlock_replica_timeout``.
    """
    spec = _locate(conf)
    min_replicas, timeout = replication_settings(conf, spec.topology)
    return replace(spec, min_replicas=min_replicas, replica_timeout=timeout)


def _locate(conf: Mapping[str, Any]) -> StoreSpec:
    value = conf.get(URL_SETTING)
    if value is not None:
        return _parse(value, URL_SETTING, conf.get(OPTIONS_SETTING), OPTIONS_SETTING)
    broker = conf.get("broker_url")
    if isinstance(broker, (list, tuple)):
        broker = ";".join(str(url) for url in broker)
    if isinstance(broker, str):
        parts = [_unix_url(part) for part in _split(broker)]
        scheme = _scheme(parts[0]) if parts else ""
        if scheme == SENTINEL_SCHEME:
            return _parse(
                broker,
                "broker_url",
                conf.get("broker_transport_options"),
                "broker_transport_options",
            )
        if scheme in REDIS_SCHEMES:
            # Failover lists are written "url1;url2"; the first is the primary.
            return _parse(parts[0], "broker_url", None, "")
    raise ConfigurationError(
        URL_SETTING,
        None,
        f"is not set and the broker URL ({redact_url(broker)}) is not a Redis URL; "
        "set redlock_url = 'redis://host:6379/0'",
    )


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(";") if part.strip()]


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def _unix_url(url: Any) -> Any:
    """Read kombu's ``redis+socket:///path`` (or ``socket://``) as ``unix:///path``.

    kombu names the database ``virtual_host`` in the query; redis-py ``db``.
    Anything else is returned as it is.
    """
    if not isinstance(url, str) or _scheme(url) not in SOCKET_SCHEMES:
        return url
    unix = "unix://" + url.partition("://")[2]
    return re.sub(r"(?<=[?&])virtual_host=", "db=", unix)


def _parse(value: Any, setting: str, options: Any, options_setting: str) -> StoreSpec:
    if isinstance(value, (list, tuple)):
        return _parse_masters(value, setting)
    if not isinstance(value, str):
        raise ConfigurationError(setting, value, _EXPECTED)
    parts = [_unix_url(part) for part in _split(value)]
    schemes = {_scheme(part) for part in parts}
    if not parts or len(schemes) != 1:
        raise ConfigurationError(setting, redact_url(value), _EXPECTED)
    scheme = schemes.pop()
    if scheme in REDIS_SCHEMES:
        if len(parts) > 1:
            raise ConfigurationError(
                setting,
                redact_url(value),
                "lists several Redis URLs in one string; give a Python list of URLs "
                "for a Redlock over independent masters",
            )
        _check_redis_url(setting, parts[0])
        return StoreSpec("redis", (parts[0],), setting)
    if scheme in CLUSTER_SCHEMES:
        for part in parts:
            _check_node_url(setting, part, "cluster")
        return StoreSpec("cluster", tuple(parts), setting)
    if scheme == SENTINEL_SCHEME:
        for part in parts:
            _check_node_url(setting, part, "sentinel")
        return StoreSpec(
            "sentinel", tuple(parts), setting, _sentinel_options(options, options_setting)
        )
    raise ConfigurationError(setting, redact_url(value), _EXPECTED)


_EXPECTED = (
    "must be a redis://, rediss:// or unix:// URL, a list of them (Redlock), "
    "redis+cluster://host:port[;...] (Redis Cluster) or sentinel://host:port[;...] "
    "(Sentinel, with master_name in redlock_transport_options)"
)


def _parse_masters(value: Sequence[Any], setting: str) -> StoreSpec:
    if not value:
        raise ConfigurationError(setting, value, "must not be an empty list")
    seen: dict[tuple[Any, ...], int] = {}
    value = [_unix_url(url) for url in value]
    for i, url in enumerate(value):
        where = f"{setting}[{i}]"
        if not isinstance(url, str) or _scheme(url) not in REDIS_SCHEMES:
            raise ConfigurationError(
                where,
                redact_url(url),
                "must be a redis://, rediss:// or unix:// URL: Redlock's masters are "
                "independent servers, not Cluster or Sentinel groups",
            )
        address = _check_redis_url(where, url)
        if address in seen:
            # Two entries for one server would give it two votes.
            raise ConfigurationError(
                where, redact_url(url), f"names the same server as {setting}[{seen[address]}]"
            )
        seen[address] = i
    if len(value) == 1:
        return StoreSpec("redis", (value[0],), setting)
    return StoreSpec("redlock", tuple(value), setting)


def _check_redis_url(setting: str, url: str) -> tuple[Any, ...]:
    """Validate a plain Redis URL as redis-py would read it; return its server address."""
    try:
        kwargs = redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigurationError(setting, redact_url(url), str(exc)) from None
    if _scheme(url) == "unix":
        if not kwargs.get("path"):
            raise ConfigurationError(setting, redact_url(url), "names no socket path")
        return ("unix", kwargs["path"])
    _check_db(setting, url, allow_nonzero=True)
    # redis-py reads "redis://" as localhost:6379.
    return (kwargs.get("host", "localhost"), kwargs.get("port", 6379))


def _check_node_url(setting: str, url: str, topology: str) -> None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigurationError(setting, redact_url(url), str(exc)) from None
    if not parts.hostname:
        raise ConfigurationError(setting, redact_url(url), "names no host")
    if topology == "cluster":
        _check_db(setting, url, allow_nonzero=False)
    else:
        _check_db(setting, url, allow_nonzero=True)


def _check_db(setting: str, url: str, *, allow_nonzero: bool) -> None:
    path = unquote(urlsplit(url).path).strip("/")
    if not path:
        return
    if not path.isdigit():
        raise ConfigurationError(setting, redact_url(url), f"has a bad database {path!r}")
    if int(path) != 0 and not allow_nonzero:
        raise ConfigurationError(
            setting, redact_url(url), "selects a database; Redis Cluster has only database 0"
        )


def _sentinel_options(options: Any, setting: str) -> dict[str, Any]:
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigurationError(setting, options, "must be a mapping")
    master_name = options.get("master_name")
    if not isinstance(master_name, str) or not master_name:
        raise ConfigurationError(
            setting,
            master_name,
            "needs 'master_name' (the Sentinel service name) for a sentinel:// lock store",
        )
    min_other = options.get("min_other_sentinels", 0)
    if isinstance(min_other, bool) or not isinstance(min_other, int) or min_other < 0:
        raise ConfigurationError(
            f"{setting}['min_other_sentinels']", min_other, "must be a whole number >= 0"
        )
    sentinel_kwargs = options.get("sentinel_kwargs")
    if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, Mapping):
        raise ConfigurationError(
            f"{setting}['sentinel_kwargs']", sentinel_kwargs, "must be a mapping"
        )
    return {name: options[name] for name in _SENTINEL_OPTIONS if name in options}


def redact_url(url: Any) -> str:
    """Return ``url`` with its password masked, for messages and logs."""
    if not isinstance(url, str):
        return repr(url)
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    if password:
        return url.replace(f":{password}@", ":***@")
    return url


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

    def lock(self, name: str, **kwargs: Any) -> Lock:
        """Return a lock on key ``name``: a :class:`Redlock` over a list of masters, else a Lock.

        Keyword arguments are :class:`~celery_redlock.lock.Lock`'s.

        Raises:
            redis.exceptions.RedisError: When building the client needs a
                server that does not answer (Redis Cluster only).
        """
        client = self.client
        if self.spec.topology == "redlock":
            return Redlock(client, name, **kwargs)
        kwargs.setdefault("min_replicas", self.min_replicas())
        if self.spec.replica_timeout is not None:
            kwargs.setdefault("replica_timeout", self.spec.replica_timeout)
        return Lock(client, name, **kwargs)

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

    def release_held_by(self, name: str, fragment: str) -> int:
        """Delete lock ``name`` where its value holds ``fragment``; return how many masters did.

        Used to free the lock of a holder known dead (see ``hooks.py``). On
        Redlock every master is asked; one that fails is left to the TTL.

        Raises:
            redis.exceptions.RedisError: When no master could be asked.
        """
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
        host, port, kwargs = _node_kwargs(url, _DEFAULT_PORTS["cluster"])
        kwargs.pop("db", None)  # only 0 gets past parse_store
        nodes.append(ClusterNode(host, port))  # type: ignore[no-untyped-call]
        options.update(kwargs)
    if _scheme(urls[0]) == "rediss+cluster":
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
        host, port, kwargs = _node_kwargs(url, _DEFAULT_PORTS["sentinel"])
        sentinels.append((host, port))
        # As in kombu: credentials and database in the URL are the master's.
        master.update(kwargs)
    sentinel_kwargs = dict(spec.options.get("sentinel_kwargs") or {})
    for option, seconds in timeouts.items():
        sentinel_kwargs.setdefault(option, seconds)
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        sentinels,
        min_other_sentinels=spec.options.get("min_other_sentinels", 0),
        sentinel_kwargs=sentinel_kwargs,
    )
    return sentinel.master_for(spec.options["master_name"], **master)  # type: ignore[no-untyped-call]


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
