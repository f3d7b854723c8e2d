"""The lock store's health check: run the lock's own scripts on a probe key on every master.

A ``PING`` proves little: a server can answer it and still refuse every lock,
because the Redis user may not touch keys under the lock prefix (an ACL user
limited to ``~other:*``), scripting may be disabled, or a Cluster primary may
be down while the startup node answers. So the check does what a lock does, on
each master that holds locks (the one Redis, each Redlock master, each Cluster
primary, the Sentinel group's current master) and under each key prefix in use:
acquire with a fence, renew, release, each with the script a task uses, on a
key that nothing else uses. The probe key expires within
:data:`PROBE_TTL_MS` even if the check dies half way. A store whose locks need
replicas' confirmation (``redlock_min_replicas``) also has each master's
replicas counted: too few connected is a warning, not a failure, since replicas
may join later (see :func:`~celery_redlock.core.replica_settings.replica_warnings`).

Nothing here runs on a task's path: it serves ``celery redlock check`` and the
worker's start-up check.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    RedisClusterException,
    RedisError,
    ResponseError,
)

from .error_text import describe_error
from .exceptions import LockError
from .fences import fence_key_for, is_cluster
from .lock_options import DEFAULT_FENCE_RETENTION
from .replica_settings import replica_warnings
from .scripts import ACQUIRE, RELEASE, RENEW
from .store import LockStore, redact_url

__all__ = ["NodeCheck", "StoreCheck", "check_store", "probe_key", "run_lock_scripts"]

#: Lifetime of a probe key, in milliseconds.
PROBE_TTL_MS = 10_000
#: The fence counter's lifetime a probe renews: the default every lock uses.
FENCE_RETENTION_MS = int(DEFAULT_FENCE_RETENTION * 1000)
#: Eviction policies under which Redis never drops keys to free memory.
SAFE_POLICIES = ("noeviction",)
#: Hash tags tried to find a probe key served by a given Cluster primary.
_CLUSTER_TAG_ATTEMPTS = 100_000


def probe_key(prefix: str, tag: str) -> str:
    """The probe key under ``prefix``: ``<prefix>:check:{<tag>}``, in the slot of ``tag``.

    It is not a task lock key (``celery redlock list`` never shows it), but
    it lies under the same prefix, so an ACL key pattern that admits locks
    admits it, and one that refuses locks refuses it.
    """
    return f"{prefix}:check:{{{tag}}}"


def run_lock_scripts(client: Any, key: str, *, cluster: bool = False) -> None:
    """Acquire ``key`` with a fence, renew it and release it, with the lock's scripts.

    Args:
        client: A plain redis-py client of one server.
        key: The probe key (see :func:`probe_key`).
        cluster: Whether the server is a Redis Cluster master (the fence
            counter is then its slot's).

    Raises:
        redis.exceptions.RedisError: What the server or connection raised
            (``NoPermissionError`` for an ACL that refuses the key).
        LockError: When a script answered something a working lock never gets.
    """
    token = secrets.token_hex(16)
    # The probe's key has a prefix of its own (``<prefix>:check:``), so its
    # fence counter serves only the probe: it goes with the probe's lock.
    fence_key = fence_key_for(key, cluster=cluster or is_cluster(client))
    fence = ACQUIRE(client, (key, fence_key), (token, PROBE_TTL_MS, FENCE_RETENTION_MS, "0"))
    if not isinstance(fence, int) or fence <= 0:
        raise LockError(f"acquire of probe key {key} answered {fence!r}, not a fence", key)
    try:
        renewed = RENEW(client, (key,), ("1", token, PROBE_TTL_MS))
        if list(renewed) != [PROBE_TTL_MS]:
            raise LockError(f"renewal of probe key {key} answered {renewed!r}", key)
    finally:
        released = RELEASE(client, (key,), (token, "0"))
        client.delete(fence_key)
    if released != 1:
        raise LockError(f"release of probe key {key} answered {released!r}", key)


@dataclass(frozen=True)
class NodeCheck:
    """How one master fared.

    Attributes:
        name: ``host:port`` (or socket path) of the master.
        error: Why it failed, ``None`` when every probe passed.
        version: Its ``redis_version``, when it told.
        eviction_policy: Its ``maxmemory-policy`` when that may evict lock
            keys (a memory limit is set and the policy is not ``noeviction``).
        replica_problems: Why it cannot confirm locks with the replicas the
            store requires now (it reports itself a replica, too few are
            connected, or they could not be counted).
    """

    name: str
    error: BaseException | None = None
    version: str | None = None
    eviction_policy: str | None = None
    replica_problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether the lock scripts ran on this master."""
        return self.error is None

    def problem(self) -> str:
        """One phrase saying what failed here, with the error's cause."""
        if self.error is None:
            return f"{self.name} is fine"
        if isinstance(self.error, (ResponseError, LockError)):
            return f"{self.name} refused the lock scripts: {describe_error(self.error)}"
        if isinstance(self.error, (AuthenticationError, AuthorizationError)):
            return f"{self.name} refused the credentials: {describe_error(self.error)}"
        return f"{self.name} is unreachable: {describe_error(self.error)}"


@dataclass(frozen=True)
class StoreCheck:
    """The outcome of :func:`check_store`.

    Attributes:
        address: The store, as messages name it (passwords masked).
        prefixes: The key prefixes probed.
        nodes: One entry per master.
        error: Why the masters could not even be listed (a Cluster whose
            startup nodes do not answer, Sentinels that name no master).
        min_replicas: How many replicas confirm each lock made on the store.
    """

    address: str
    prefixes: tuple[str, ...]
    nodes: tuple[NodeCheck, ...] = ()
    error: BaseException | None = field(default=None)
    min_replicas: int = 0

    @property
    def ok(self) -> bool:
        """Whether the lock scripts ran on every master under every prefix."""
        return self.error is None and bool(self.nodes) and all(node.ok for node in self.nodes)

    @property
    def warnings(self) -> list[str]:
        """What passing lock scripts do not rule out: eviction, too few replicas connected."""
        found = [
            f"{node.name} has maxmemory-policy {node.eviction_policy}, which can evict locks"
            for node in self.nodes
            if node.eviction_policy is not None
        ]
        return found + [problem for node in self.nodes for problem in node.replica_problems]

    def failure(self) -> str:
        """One line saying why the check failed (empty when it passed)."""
        if self.error is not None:
            return f"lock store {self.address} is unreachable: {describe_error(self.error)}"
        if not self.nodes:
            return f"lock store {self.address} names no master"
        failed = [node.problem() for node in self.nodes if not node.ok]
        if not failed:
            return ""
        return f"lock store {self.address} failed the lock check: {'; '.join(failed)}"

    def summary(self) -> str:
        """One line: the failure, or what passed (and any warning)."""
        if not self.ok:
            return self.failure()
        versions = sorted({node.version or "?" for node in self.nodes})
        prefixes = ", ".join(f"{prefix}:" for prefix in self.prefixes)
        masters = ", ".join(node.name for node in self.nodes)
        line = (
            f"lock store {self.address} (Redis {', '.join(versions)}) answers: acquire, "
            f"renew and release ran under {prefixes} on {masters}"
        )
        if self.min_replicas:
            line += f"; each lock is confirmed by {self.min_replicas} replica(s)"
        return "; ".join([line, *(f"WARNING: {text}" for text in self.warnings)])


def check_store(store: LockStore, prefixes: Sequence[str]) -> StoreCheck:
    """Run the lock scripts under each of ``prefixes`` on every master of ``store``.

    Never raises for a store error: each one is reported in the result.
    """
    prefixes = tuple(dict.fromkeys(prefixes))
    address = store.spec.describe()
    try:
        masters = _masters(store)
        needed = store.min_replicas()
    except (RedisError, RedisClusterException) as exc:
        return StoreCheck(address, prefixes, error=exc)
    tag = secrets.token_hex(8)
    cluster = store.spec.topology == "cluster"
    nodes = tuple(
        _check_node(client, name, prefixes, tag, key_for, needed, cluster)
        for client, name, key_for in masters
    )
    return StoreCheck(address, prefixes, nodes, min_replicas=needed)


def _check_node(
    client: Any,
    name: str,
    prefixes: Sequence[str],
    tag: str,
    key_for: Any,
    needed: int,
    cluster: bool,
) -> NodeCheck:
    try:
        for prefix in prefixes:
            run_lock_scripts(client, key_for(prefix, tag), cluster=cluster)
    except (RedisError, LockError) as exc:
        return NodeCheck(name, error=exc)
    return NodeCheck(
        name,
        version=_version(client),
        eviction_policy=_eviction_policy(client),
        replica_problems=_replica_problems(client, name, needed),
    )


def _replica_problems(client: Any, name: str, needed: int) -> tuple[str, ...]:
    """Why the master cannot confirm locks with ``needed`` replicas now; empty if it can."""
    try:
        return tuple(replica_warnings(client, name, needed))
    except RedisError as exc:
        return (f"{name}: could not read its replicas: {describe_error(exc)}",)


def _masters(store: LockStore) -> list[tuple[Any, str, Any]]:
    """``(client, name, key_for)`` of each master; ``key_for`` gives a probe key it serves.

    Raises:
        redis.exceptions.RedisError: When the masters cannot be found out.
    """
    client = store.client
    topology = store.spec.topology
    if topology == "cluster":
        return [
            (node.redis_connection, node.name, _cluster_key_for(client, node.name))
            for node in client.get_primaries()
        ]
    clients = list(client) if topology == "redlock" else [client]
    return [(one, _node_name(one), probe_key) for one in clients]


def _cluster_key_for(cluster: Any, node_name: str) -> Any:
    """A ``key_for`` giving keys in slots the Cluster primary ``node_name`` serves."""

    def key_for(prefix: str, tag: str) -> str:
        for attempt in range(_CLUSTER_TAG_ATTEMPTS):
            key = probe_key(prefix, f"{tag}-{attempt}")
            if cluster.get_node_from_key(key).name == node_name:
                return key
        raise LockError(f"no probe key found in the slots of Cluster primary {node_name}")

    return key_for


def _node_name(client: Any) -> str:
    pool: Any = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", {})
    if "host" in kwargs:
        return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
    if "path" in kwargs:
        return redact_url(kwargs["path"])
    service = getattr(pool, "service_name", None)
    if service is not None:
        # Asks the Sentinels: MasterNotFoundError (a ConnectionError) when none names one.
        host, port = pool.get_master_address()
        return f"{host}:{port} (Sentinel master {service!r})"
    return repr(client)


def _version(client: Any) -> str | None:
    try:
        return str(client.info("server").get("redis_version", "?"))
    except RedisError:  # INFO may be refused to a user that may lock
        return None


def _eviction_policy(client: Any) -> str | None:
    """Return the eviction policy of ``client``'s server if it may drop lock keys."""
    try:
        config = client.config_get("maxmemory*")
    except RedisError:  # CONFIG is often disabled on managed Redis
        return None
    policy = _text(config.get("maxmemory-policy") or config.get(b"maxmemory-policy"))
    limit = _text(config.get("maxmemory") or config.get(b"maxmemory")) or "0"
    if policy and policy not in SAFE_POLICIES and limit != "0":
        return policy
    return None


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode()
    return None if value is None else str(value)
