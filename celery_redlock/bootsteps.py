"""Worker start: validate the configuration, check the lock store, turn on per-queue locking.

:class:`RedlockStep` is a worker bootstep. Its constructor runs in the main
process before the pool starts, which is what per-queue locking needs: it
wraps the plain tasks' bodies before the pool builds the tracers that capture
them, and forked prefork children inherit the wrapped tasks. Spawned children
inherit nothing; the step hands them what they need to do the same
themselves (:mod:`celery_redlock.spawned`). The lock counters' shared memory
is created there too (forked children only: see :data:`SPAWN_STATS_WARNING`),
and the stale locks of a dead earlier run of the worker are released before
it takes any task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery import bootsteps
from redis.exceptions import RedisError

from . import control, spawned, stats
from .conf import check_settings, flag, parse_queues
from .exceptions import ConfigurationError
from .inventory import clients_of
from .queues import QueueLocks, check_guarded_tasks, lock_plain_tasks, register
from .recovery import lock_prefixes, recover_stale
from .replica_settings import replica_warnings
from .store import redact_url, store_for

__all__ = ["RedlockStep", "check_lock_store", "prepare_worker", "recover_at_start"]

logger = logging.getLogger(__name__)

#: Why a worker whose pool spawns its processes counts nothing (logged once, at start).
SPAWN_STATS_WARNING = (
    "lock counters (redlock_stats) are off on this worker: its prefork pool starts its "
    "processes with spawn, and spawned processes cannot reach the counters' memory, which "
    "only forked ones share; set redlock_stats = False to silence this warning"
)

#: Eviction policies under which Redis never drops keys to free memory.
_SAFE_POLICIES = ("noeviction",)


def prepare_worker(
    app: Any, cli_queues: str | None, consumed: Mapping[str, Any], *, announce: bool = True
) -> QueueLocks:
    """Validate every redlock setting and set up per-queue locking for one worker.

    Runs in the worker's main process, and again in each spawned pool process
    (see :mod:`celery_redlock.spawned`). Every queue named in ``redlock_queues``
    or ``--redlock-queues`` is locked whenever the worker consumes it, also
    when it starts consuming it later (see :mod:`celery_redlock.added_queues`);
    ``--redlock-queues`` must name queues the worker consumes at start.

    Args:
        app: The worker's app.
        cli_queues: The ``--redlock-queues`` value, if given.
        consumed: The queues this worker consumes, by name.
        announce: Log the locked queues at INFO (the main process does, once).

    Raises:
        ConfigurationError: Naming the first bad setting, option or queue.
    """
    queues = check_settings(app.conf)
    for name in parse_queues(cli_queues, "--redlock-queues"):
        if name not in consumed:
            raise ConfigurationError(
                "--redlock-queues",
                name,
                f"is not a queue this worker consumes ({', '.join(sorted(consumed))})",
            )
        queues.setdefault(name, {})
    # Every locked queue, consumed or not: the worker may be told to consume one
    # later (add_consumer), and its pool processes must already know it then.
    locks = QueueLocks(queues, consumed.values(), app.amqp.queues.values())
    check_guarded_tasks(app, locks, sorted(locks.consumed))
    register(app, locks)
    wrapped = lock_plain_tasks(app) if locks.locked else 0
    if announce and locks.consumed:
        logger.info(
            "celery-redlock: locking tasks from queue(s) %s (%d plain task(s) wrapped)",
            ", ".join(sorted(locks.consumed)),
            wrapped,
        )
    waiting = sorted(locks.locked.keys() - locks.consumed)
    if announce and waiting:
        logger.info(
            "celery-redlock: queue(s) %s will be locked if this worker is told to consume "
            "them (add_consumer)%s",
            ", ".join(waiting),
            "" if locks.consumed else f" ({wrapped} plain task(s) wrapped)",
        )
    return locks


def check_lock_store(app: Any) -> str:
    """Ping the lock store and warn about settings that endanger locks; return a summary line.

    Every master is checked: each one of a Redlock or a Redis Cluster, the
    current master of a Sentinel group. Never raises: a lock store that is down
    at worker start is reported, and each task's ``on_redis_error`` policy
    handles it when it runs.
    """
    store = store_for(app)
    address = store.spec.describe()
    try:
        masters = store.masters()
        needed = store.min_replicas()
    except RedisError as exc:
        logger.error("celery-redlock: lock store %s is unreachable: %r", address, exc)
        return f"lock store {address} is unreachable: {exc!r}"
    versions, problems = [], []
    for client in masters:
        name = _name(client)
        try:
            client.ping()
            versions.append(client.info("server").get("redis_version", "?"))
        except RedisError as exc:
            logger.error("celery-redlock: lock store master %s is unreachable: %r", name, exc)
            problems.append(f"{name} is unreachable: {exc!r}")
            continue
        policy = _eviction_policy(client)
        if policy is not None:
            logger.warning(
                "celery-redlock: lock store master %s has maxmemory-policy %s: under memory "
                "pressure it may evict lock keys and let duplicates run; use noeviction",
                name,
                policy,
            )
            problems.append(f"WARNING: {name} has maxmemory-policy {policy}, which can evict locks")
        problems += _replica_problems(client, name, needed)
    if not versions:
        return f"lock store {address} is unreachable: {'; '.join(problems)}"
    summary = f"lock store {address} (Redis {', '.join(sorted(set(versions)))}) answers"
    if needed:
        summary += f"; each lock is confirmed by {needed} replica(s)"
    if problems:
        summary += "; " + "; ".join(problems)
    logger.info("celery-redlock: %s", summary)
    return summary


def _replica_problems(client: Any, name: str, needed: int) -> list[str]:
    """Warn about a master that cannot confirm locks with ``needed`` replicas now."""
    try:
        found = replica_warnings(client, name, needed)
    except RedisError as exc:
        found = [f"{name}: could not read its replicas: {exc!r}"]
    for problem in found:
        logger.warning("celery-redlock: lock store master %s", problem)
    return [f"WARNING: {problem}" for problem in found]


def _name(client: Any) -> str:
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if "host" in kwargs:
        return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
    return redact_url(kwargs.get("path", repr(client)))


def _eviction_policy(client: Any) -> str | None:
    """Return the eviction policy of ``client``'s server if it may drop lock keys."""
    try:
        config = client.config_get("maxmemory*")
    except RedisError:  # CONFIG is often disabled on managed Redis
        return None
    policy = config.get("maxmemory-policy") or config.get(b"maxmemory-policy")
    limit = config.get("maxmemory") or config.get(b"maxmemory")
    if isinstance(policy, bytes):
        policy = policy.decode()
    if policy and policy not in _SAFE_POLICIES and str(limit or "0") != "0":
        return str(policy)
    return None


def recover_at_start(app: Any, node: str) -> int:
    """Release the locks left by a dead earlier run of worker ``node``; return how many.

    Never raises: a lock store that fails here leaves the stale locks to
    expire with their TTL, as without recovery.
    """
    try:
        released = [
            info
            for client in clients_of(store_for(app))
            for info in recover_stale(client, lock_prefixes(app), node)
        ]
    except Exception as exc:  # RedisError, or a Cluster that cannot be discovered
        logger.warning("celery-redlock: stale-lock recovery skipped: %r", exc)
        return 0
    logger.info(
        "celery-redlock: stale-lock recovery for %s released %d lock(s)", node, len(released)
    )
    return len(released)


def _pool_size(worker: Any) -> int:
    # Autoscaling (--autoscale=max,min) may grow the pool past -c up to its maximum.
    sizes = [getattr(worker, "concurrency", 0), *(getattr(worker, "autoscale", None) or ())]
    return max([size for size in sizes if isinstance(size, int)] + [1])


class RedlockStep(bootsteps.Step):  # type: ignore[misc]  # celery ships no type hints
    """Worker bootstep of celery-redlock (added by :func:`celery_redlock.install`).

    Receives the ``--redlock-queues`` worker option as ``redlock_queues`` and
    ``--redlock-recover/--no-redlock-recover`` as ``redlock_recover_stale``
    (which wins over the setting of that name). A configuration error
    stops a command-line worker with one line naming the setting and value; a
    programmatic worker gets the ``ConfigurationError``.
    """

    name = "celery-redlock"

    def __init__(
        self,
        worker: Any,
        redlock_queues: str | None = None,
        redlock_recover_stale: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(worker, **kwargs)
        app = worker.app
        try:
            consumed = dict(app.amqp.queues.consume_from)
            self.locks = prepare_worker(app, redlock_queues, consumed)
            recover = flag(app.conf, "redlock_recover_stale", True)
            if redlock_recover_stale is not None:
                if not isinstance(redlock_recover_stale, bool):
                    raise ConfigurationError(
                        "--redlock-recover", redlock_recover_stale, "must be True or False"
                    )
                recover = redlock_recover_stale
            counting = flag(app.conf, "redlock_stats", True)
        except ConfigurationError as exc:
            from celery.apps.worker import Worker as CommandLineWorker

            if isinstance(worker, CommandLineWorker):
                raise SystemExit(f"celery-redlock: configuration error: {exc}") from None
            raise
        check_lock_store(app)
        spawning = spawned.spawns_pool_processes(worker)
        if spawning and self.locks.locked:
            spawned.hand_over(app, redlock_queues, consumed)
        self.stats = None
        if counting and spawning:
            # The counters live in anonymous shared memory that only forked
            # processes share. A named block would outlive a killed worker;
            # counting in Redis would cost a round trip per task. Say so
            # rather than report zeros.
            logger.warning("celery-redlock: %s", SPAWN_STATS_WARNING)
            stats.disable(app, SPAWN_STATS_WARNING)
        elif counting:
            self.stats = stats.enable(app, _pool_size(worker))
        logger.debug("celery-redlock: %s command registered", control.STATS_COMMAND)
        self.recovered = recover_at_start(app, worker.hostname) if recover else 0
