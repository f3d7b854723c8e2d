"""Replicated acquisition: a lock counts as held only once enough replicas have it.

Redis replicates asynchronously: a master grants a lock and answers before any
replica has it, so a failover can lose a granted lock and let a second holder
in. A lock with ``min_replicas`` sends ``WAIT min_replicas timeout`` right
behind each acquire and renew script, in the same write on the same connection,
so the acknowledgement costs a wait for the replicas but no extra round trip.
With too few acknowledgements an acquisition is given back (compare-and-delete)
and a renewal does not count; both raise
:class:`~celery_redlock.core.exceptions.ReplicationError`, a ``RedisError``, which a
task meets as a lock store failure (its ``lock_on_redis_error`` policy).

The same answers tell a client that its server is no longer a master it may
trust: too few acknowledgements (its replica was promoted away, or it is cut
off), ``READONLY`` (it was demoted) or ``NOREPLICAS`` (its own
``min-replicas-to-write`` is not met). Each such event is logged once per server
when it starts, and once when acknowledgements come back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, ReadOnlyError, RedisError, ResponseError

from .exceptions import ConfigurationError, ReplicationError
from .lua import Arg, Script
from .replica_settings import check_min_replicas, check_replica_timeout
from .reserved import drop_connections
from .scripts import ACQUIRE, RELEASE, RENEW

__all__ = [
    "DEFAULT_REPLICA_TIMEOUT",
    "Replication",
    "acquire",
    "check_acknowledged",
    "renew",
    "replication_for",
    "server_of",
]

logger = logging.getLogger(__name__)

ACQUISITION, RENEWAL = "acquisition", "renewal"

#: Longest wait for the replicas' acknowledgement, in seconds, unless set; a
#: tenth of the lock's TTL when that is shorter.
DEFAULT_REPLICA_TIMEOUT = 0.5


@dataclass(frozen=True)
class Replication:
    """How many replicas must acknowledge each lock write, and how long to wait for them.

    Attributes:
        replicas: Acknowledgements needed (at least 1).
        timeout: Longest wait for them, in seconds.
    """

    replicas: int
    timeout: float

    @property
    def wait(self) -> tuple[str, int, int]:
        """The ``WAIT`` command sent behind each write (its timeout never 0: 0 waits forever)."""
        return ("WAIT", self.replicas, max(1, int(self.timeout * 1000)))


def replication_for(
    min_replicas: object, replica_timeout: object, ttl: float | None, client: Any
) -> Replication | None:
    """Validate a lock's ``min_replicas`` and ``replica_timeout``; ``None`` when 0 replicas.

    Raises:
        ConfigurationError: Naming the argument at fault.
    """
    replicas = check_min_replicas("min_replicas", min_replicas)
    timeout = check_replica_timeout("replica_timeout", replica_timeout)
    if not replicas:
        return None
    assert isinstance(replicas, int)
    if timeout is None:
        timeout = DEFAULT_REPLICA_TIMEOUT if ttl is None else min(DEFAULT_REPLICA_TIMEOUT, ttl / 10)
        timeout = max(0.001, timeout)
    elif ttl is not None and timeout >= ttl:
        raise ConfigurationError(
            "replica_timeout", timeout, f"must be shorter than the lock's timeout ({ttl} s)"
        )
    if getattr(client, "connection", None) is not None:
        raise ConfigurationError(
            "min_replicas",
            replicas,
            "needs a client with a connection pool (WAIT must follow the write on its "
            "connection); this one is a single_connection_client",
        )
    return Replication(replicas, timeout)


# -- sending -------------------------------------------------------------------------


def acquire(
    client: Any,
    keys: Sequence[Arg],
    args: Sequence[Arg],
    replication: Replication,
    label: str | None = None,
) -> Any:
    """Run the acquire script and ``WAIT`` in one round trip; return the script's reply.

    A contended reply is returned whatever the replicas said. A grant that too
    few replicas acknowledged is given back on the server that made it.

    Raises:
        ReplicationError: Too few acknowledgements (the lock was given back),
            or the server refused the write as a replica or an isolated master.
        redis.exceptions.RedisError: Whatever else the server or connection raises.
    """
    target, reply, acknowledged = _exchange(ACQUIRE, client, keys, args, replication, label)
    if isinstance(reply, list):
        return reply
    if acknowledged >= replication.replicas:
        _events.clear(target, acknowledged, replication.replicas)
        return reply
    try:
        RELEASE(target, (keys[0],), (args[0], "0"))
    except RedisError as exc:
        logger.warning(
            "%s: could not give back the unreplicated grant (%r); it expires with its TTL",
            _describe(keys[0], label, ACQUISITION),
            exc,
        )
    raise _shortfall(target, keys[0], label, acknowledged, replication)


def renew(
    client: Any,
    keys: Sequence[Arg],
    args: Sequence[Arg],
    replication: Replication,
    label: str | None = None,
    script: Script = RENEW,
) -> list[int]:
    """Run the renew script (a lock's, or a semaphore's) and ``WAIT`` in one round trip.

    Returns the script's reply.

    Raises:
        ReplicationError: When a renewal that took effect was acknowledged by
            too few replicas: it does not count. (A reply of only zeros, no
            lock renewed, is returned as it is.)
        redis.exceptions.RedisError: Whatever else the server or connection raises.
    """
    target, reply, acknowledged = _exchange(script, client, keys, args, replication, label)
    check_acknowledged(target, acknowledged, replication, keys[0], label, renewed=any(reply))
    return list(reply)


def check_acknowledged(
    client: Any,
    acknowledged: int,
    replication: Replication,
    name: Arg,
    label: str | None = None,
    *,
    renewed: bool = True,
) -> None:
    """Accept renewals ``acknowledged`` by enough replicas; log the event when not.

    Raises:
        ReplicationError: When too few replicas acknowledged writes that took effect.
    """
    if acknowledged >= replication.replicas or not renewed:
        if renewed:
            _events.clear(client, acknowledged, replication.replicas)
        return
    raise _shortfall(client, name, label, acknowledged, replication, RENEWAL)


def _exchange(
    script: Script,
    client: Any,
    keys: Sequence[Arg],
    args: Sequence[Arg],
    replication: Replication,
    label: str | None,
) -> tuple[Any, Any, int]:
    """Send ``script`` and ``WAIT`` to the master of ``keys[0]``: (that client, reply, acks)."""
    cluster = isinstance(client, RedisCluster)
    for attempt in (1, 2):
        target = _master_of(client, keys[0]) if cluster else client
        try:
            reply, acknowledged = script(target, keys, args, then=replication.wait)
        except MovedError:
            # A Cluster failover moved the slot (the old master is a replica
            # now): learn the new map and send once more, to the new master.
            if attempt == 2 or not cluster:
                raise
            client.nodes_manager.initialize()
            continue
        except RedisConnectionError:
            if cluster:
                _refresh(client)
            raise
        except ResponseError as exc:
            event = _refusal(exc)
            if event is None:
                raise
            operation = ACQUISITION if script is ACQUIRE else RENEWAL
            raise _refused(target, event, exc, keys[0], label, replication, operation) from exc
        return target, reply, int(acknowledged)
    raise AssertionError("unreachable")  # pragma: no cover


def _master_of(cluster: Any, key: Arg) -> Any:
    """The plain client of the Cluster node serving ``key``: WAIT must go to that node."""
    return cluster.get_redis_connection(cluster.get_node_from_key(key))


def _refresh(client: Any) -> None:
    # The next command asks the cluster for its slots again; a failure here is
    # the same outage the caller is about to report.
    try:
        client.nodes_manager.initialize()
    except Exception:
        logger.debug("Cluster slot refresh failed", exc_info=True)


def _refusal(exc: ResponseError) -> str | None:
    """The topology event a server's error reply reports, if it reports one."""
    if isinstance(exc, ReadOnlyError) or str(exc).startswith("READONLY"):
        return "demoted"
    if str(exc).startswith("NOREPLICAS"):
        return "isolated"
    return None


# -- what the answers say about the topology ---------------------------------------

_EVENTS = {
    "replicas": (
        "{server}: only {acknowledged} of {needed} replica(s) acknowledged the {lock} within "
        "{timeout} s: its replicas left or lag, or a failover promoted one and this master "
        "is stale or cut off; no lock counts as held here until enough replicas acknowledge"
    ),
    "demoted": (
        "{server} reports itself a replica (READONLY): a failover demoted it; the {lock} "
        "and every other lock write are refused there"
    ),
    "isolated": (
        "{server} refuses writes (NOREPLICAS): it has fewer good replicas than its "
        "min-replicas-to-write and may be cut off from them; the {lock} and every other "
        "lock write are refused there"
    ),
}


class _Events:
    """The topology event each server is in, so that each is logged once, when it starts."""

    def __init__(self) -> None:
        self._current: dict[str, str] = {}
        self._guard = threading.Lock()

    def enter(self, server: str, event: str, line: str) -> None:
        with self._guard:
            known = self._current.get(server)
            self._current[server] = event
        if known != event:
            logger.warning("celery-redlock: %s", line)
        else:
            logger.debug("celery-redlock: %s", line)

    def clear(self, client: Any, acknowledged: int, needed: int) -> None:
        if not self._current:  # the hot path: no event under way anywhere
            return
        server = server_of(client)
        with self._guard:
            known = self._current.pop(server, None)
        if known is not None:
            logger.info(
                "celery-redlock: %s: lock writes are acknowledged by %d of %d replica(s) "
                "again (after: %s)",
                server,
                acknowledged,
                needed,
                known,
            )


_events = _Events()


def _describe(name: Arg, label: str | None, operation: str) -> str:
    # No fence to name: the grant it would go with does not count.
    return f"{operation} of lock {_text(name)}" + (f" for {label}" if label else "")


def _shortfall(
    client: Any,
    name: Arg,
    label: str | None,
    acknowledged: int,
    replication: Replication,
    operation: str = ACQUISITION,
) -> ReplicationError:
    server = server_of(client)
    lock = _describe(name, label, operation)
    line = _EVENTS["replicas"].format(
        server=server,
        acknowledged=acknowledged,
        needed=replication.replicas,
        lock=lock,
        timeout=replication.timeout,
    )
    _events.enter(server, "replicas", line)
    _forget_master(client)
    return ReplicationError(
        f"{lock}: {acknowledged} of {replication.replicas} replica(s) acknowledged it on "
        f"{server} within {replication.timeout} s; it does not count",
        lock_name=_text(name),
        server=server,
        event="replicas",
        acknowledged=acknowledged,
        needed=replication.replicas,
    )


def _refused(
    client: Any,
    event: str,
    exc: ResponseError,
    name: Arg,
    label: str | None,
    replication: Replication,
    operation: str,
) -> ReplicationError:
    server = server_of(client)
    lock = _describe(name, label, operation)
    _events.enter(server, event, _EVENTS[event].format(server=server, lock=lock))
    _forget_master(client)
    return ReplicationError(
        f"{lock}: {server} refused the write ({exc})",
        lock_name=_text(name),
        server=server,
        event=event,
        needed=replication.replicas,
    )


def _forget_master(client: Any) -> None:
    # A Sentinel client keeps writing to the master it connected to: make its
    # next use ask the Sentinels which master is current.
    if hasattr(getattr(client, "connection_pool", None), "service_name"):
        drop_connections(client)


def _text(name: Arg) -> str:
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)


def server_of(client: Any) -> str:
    """Name ``client``'s server for log lines: ``host:port``, a socket, or a Sentinel service."""
    pool = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service is not None:
        address = getattr(getattr(pool, "proxy", None), "master_address", None)
        where = f" (last named {address[0]}:{address[1]})" if address else ""
        return f"Sentinel master {service!r}{where}"
    kwargs = getattr(pool, "connection_kwargs", {})
    if "host" in kwargs:
        return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
    return str(kwargs.get("path", repr(client)))
