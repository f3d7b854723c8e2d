"""How many replicas confirm each lock: settings, their checks, "auto", the worker-start check.

``redlock_min_replicas`` (a whole number, or ``"auto"``, the default) and
``redlock_replica_timeout`` configure the Celery layer's lock store; the
``min_replicas`` and ``replica_timeout`` arguments of
:class:`~celery_redlock.Lock` are checked by the same functions. What the
replicas' confirmation does is in :mod:`celery_redlock.core.replication`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Union

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from .exceptions import ConfigurationError

__all__ = [
    "AUTO",
    "MIN_REPLICAS_SETTING",
    "REPLICA_TIMEOUT_SETTING",
    "MinReplicas",
    "auto_replicas",
    "check_min_replicas",
    "check_replica_timeout",
    "replica_warnings",
    "replication_settings",
]

logger = logging.getLogger(__name__)

#: ``redlock_min_replicas`` value asking the store's topology (see :func:`auto_replicas`).
AUTO = "auto"
#: Replicas that confirm each lock of the Celery layer's store (default ``"auto"``).
MIN_REPLICAS_SETTING = "redlock_min_replicas"
#: Longest wait in seconds for that confirmation (default: the lock's own).
REPLICA_TIMEOUT_SETTING = "redlock_replica_timeout"

#: A number of replicas, or ``"auto"``.
MinReplicas = Union[int, str]


def check_min_replicas(setting: str, value: object, *, allow_auto: bool = False) -> MinReplicas:
    """Return ``value`` as a number of replicas (or ``"auto"`` where allowed).

    Raises:
        ConfigurationError: Naming ``setting``, for anything but a whole number >= 0.
    """
    if allow_auto and value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        expected = "a whole number >= 0" + (" or 'auto'" if allow_auto else "")
        raise ConfigurationError(setting, value, f"must be {expected}")
    return value


def check_replica_timeout(setting: str, value: object) -> float | None:
    """Return ``value`` as seconds (``None`` stays ``None``: the default applies).

    Raises:
        ConfigurationError: Naming ``setting``, for anything but a number >= 0.001.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0.001
    ):
        raise ConfigurationError(setting, value, "must be a number of seconds, at least 0.001")
    return float(value)


def replication_settings(
    conf: Mapping[str, Any], topology: str
) -> tuple[MinReplicas, float | None]:
    """Read ``redlock_min_replicas`` and ``redlock_replica_timeout`` for a store of ``topology``.

    Raises:
        ConfigurationError: Naming the setting with a bad value, or a number of
            replicas asked of a Redlock store.
    """
    min_replicas = check_min_replicas(
        MIN_REPLICAS_SETTING, conf.get(MIN_REPLICAS_SETTING, AUTO), allow_auto=True
    )
    if topology == "redlock" and min_replicas not in (0, AUTO):
        raise ConfigurationError(
            MIN_REPLICAS_SETTING,
            min_replicas,
            "does not apply to Redlock (redlock_url lists independent masters, whose "
            "majority is what survives a failure); use 0 or 'auto'",
        )
    timeout = check_replica_timeout(REPLICA_TIMEOUT_SETTING, conf.get(REPLICA_TIMEOUT_SETTING))
    return min_replicas, timeout


def auto_replicas(topology: str, client: Any) -> int:
    """The ``"auto"`` value of ``redlock_min_replicas`` for a store: 1 if it has replicas, else 0.

    Sentinel: the replicas the Sentinels know of the master, down ones
    included. Cluster: the fewest replicas any shard with slots has. Anything
    else (one Redis named by URL, Redlock): 0, since nothing promotes a replica
    there on its own.

    Raises:
        redis.exceptions.RedisError: When the topology cannot be asked.
    """
    if topology == "sentinel":
        count = _sentinel_replicas(client)
        source = f"the Sentinels know {count} replica(s) of the master"
    elif topology == "cluster":
        count = _cluster_replicas(client)
        source = f"the smallest Cluster shard has {count} replica(s)"
    else:
        return 0
    chosen = 1 if count else 0
    logger.info(
        "celery-redlock: redlock_min_replicas='auto' is %d on this %s store: %s",
        chosen,
        topology,
        source,
    )
    return chosen


def _sentinel_replicas(client: Any) -> int:
    pool = client.connection_pool
    failure: RedisError | None = None
    for sentinel in pool.sentinel_manager.sentinels:
        try:
            return len(sentinel.sentinel_slaves(pool.service_name))
        except RedisError as exc:
            failure = exc
    raise failure or RedisConnectionError("no Sentinel to ask")


def _cluster_replicas(client: Any) -> int:
    # Each primary is asked: the replicas its cluster view names, or those
    # connected to it, whichever is more (right after a replica joins, the
    # view may not name it yet).
    primaries = client.PRIMARIES
    views = client.execute_command("CLUSTER NODES", target_nodes=primaries)
    infos = client.execute_command("INFO", "replication", target_nodes=primaries)
    counts = []
    for name, view in views.items():
        me = next((node for node in view.values() if "myself" in node["flags"]), None)
        if me is None or not me.get("slots"):
            continue
        named = sum(
            "slave" in node["flags"] and node.get("master_id") == me["node_id"]
            for node in view.values()
        )
        connected = int(infos.get(name, {}).get("connected_slaves", 0))
        counts.append(max(named, connected))
    return min(counts, default=0)


def replica_warnings(client: Any, name: str, needed: int) -> list[str]:
    """Problems of one master with ``needed`` replicas required, as a worker start reports them.

    A master that reports itself a replica, or has fewer replicas connected
    than ``needed``, refuses every lock until that changes. That is a warning,
    not an error: replicas may be restarting and join later, and until they do
    each task follows its ``lock_on_redis_error`` policy.

    Raises:
        redis.exceptions.RedisError: When the master cannot be asked.
    """
    if not needed:
        return []
    info = client.info("replication")
    role = info.get("role")
    if role != "master":
        return [f"{name} reports role {role}: every lock is refused there"]
    connected = int(info.get("connected_slaves", 0))
    if connected >= needed:
        return []
    return [
        f"{name} has {connected} replica(s) connected and redlock_min_replicas is {needed}: "
        "every acquisition there is refused (lock_on_redis_error decides) until enough "
        "replicas connect"
    ]
