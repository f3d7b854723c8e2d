"""Reading the lock store setting: which Redis topology ``redlock_url`` names.

:func:`parse_store` reads ``redlock_url`` (or a Redis or Sentinel broker URL)
into a :class:`StoreSpec` without any I/O, so a bad setting is reported, under
the name the user wrote, when the worker starts. The topologies and their URL
forms are described in :mod:`celery_redlock.core.store`, which builds the
clients. ``redlock_min_replicas`` and ``redlock_replica_timeout`` (how many
replicas confirm each lock, see :mod:`celery_redlock.core.replica_settings`)
are read into the same :class:`StoreSpec`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

from .exceptions import ConfigurationError
from .replica_settings import AUTO, MinReplicas, replication_settings

__all__ = [
    "CLUSTER_SCHEMES",
    "DEFAULT_PORTS",
    "OPTIONS_SETTING",
    "REDIS_SCHEMES",
    "SENTINEL_SCHEME",
    "SOCKET_SCHEMES",
    "TOPOLOGIES",
    "URL_SETTING",
    "StoreSpec",
    "parse_store",
    "redact_url",
    "scheme_of",
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

#: The port of a node URL that names none, per topology.
DEFAULT_PORTS = {"redis": 6379, "cluster": 6379, "sentinel": 26379}
#: Sentinel transport options this module reads; kombu's names.
_SENTINEL_OPTIONS = ("master_name", "min_other_sentinels", "sentinel_kwargs")


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
            (decided by the topology on first use: see
            :func:`~celery_redlock.core.replica_settings.auto_replicas`).
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
        scheme = scheme_of(parts[0]) if parts else ""
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


def scheme_of(url: str) -> str:
    """The scheme of ``url``, lower-cased; ``""`` when it has none."""
    return url.partition("://")[0].lower() if "://" in url else ""


def _unix_url(url: Any) -> Any:
    """Read kombu's ``redis+socket:///path`` (or ``socket://``) as ``unix:///path``.

    kombu names the database ``virtual_host`` in the query; redis-py ``db``.
    Anything else is returned as it is.
    """
    if not isinstance(url, str) or scheme_of(url) not in SOCKET_SCHEMES:
        return url
    unix = "unix://" + url.partition("://")[2]
    return re.sub(r"(?<=[?&])virtual_host=", "db=", unix)


def _parse(value: Any, setting: str, options: Any, options_setting: str) -> StoreSpec:
    if isinstance(value, (list, tuple)):
        return _parse_masters(value, setting)
    if not isinstance(value, str):
        raise ConfigurationError(setting, value, _EXPECTED)
    parts = [_unix_url(part) for part in _split(value)]
    schemes = {scheme_of(part) for part in parts}
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
        if not isinstance(url, str) or scheme_of(url) not in REDIS_SCHEMES:
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
    if scheme_of(url) == "unix":
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
