"""Worker start: validate the configuration, check the lock store, turn on per-queue locking.

:class:`RedlockStep` is a worker bootstep. Its constructor runs in the main
process before the pool starts, which is what per-queue locking needs: it
wraps the plain tasks' bodies before the pool builds the tracers that capture
them, and forked prefork children inherit the wrapped tasks. Spawned children
inherit nothing; the step hands them what they need to do the same
themselves (:mod:`celery_redlock.celery.spawned`). The lock counters' shared memory
is created there too (forked children only: see :data:`SPAWN_STATS_WARNING`),
and the stale locks of a dead earlier run of the worker are released before
it takes any task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery import bootsteps

from celery_redlock.celery.settings import flag
from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.health import check_store
from celery_redlock.core.inventory import clients_of
from celery_redlock.core.recovery import lock_prefixes, recover_stale
from celery_redlock.core.store import store_for

from . import control, spawned, stats
from .queues import QueueLocks, lock_queues
from .worker_ops import read_ops_settings

__all__ = ["RedlockStep", "check_lock_store", "prepare_worker", "recover_at_start"]

logger = logging.getLogger(__name__)

#: Why a worker whose pool spawns its processes counts nothing (logged once, at start).
SPAWN_STATS_WARNING = (
    "lock counters (redlock_stats) are off on this worker: its prefork pool starts its "
    "processes with spawn, and spawned processes cannot reach the counters' memory, which "
    "only forked ones share; set redlock_stats = False to silence this warning"
)


def prepare_worker(
    app: Any, cli_queues: str | None, consumed: Mapping[str, Any], *, announce: bool = True
) -> QueueLocks:
    """Validate every redlock setting and set up per-queue locking for one worker.

    Runs in the worker's main process; each spawned pool process runs
    :func:`~celery_redlock.celery.queues.lock_queues` again, quietly (see
    :mod:`celery_redlock.celery.spawned`). Every queue named in ``redlock_queues``
    or ``--redlock-queues`` is locked whenever the worker consumes it, also
    when it starts consuming it later (see :mod:`celery_redlock.celery.added_queues`);
    ``--redlock-queues`` must name queues the worker consumes at start.

    Args:
        app: The worker's app.
        cli_queues: The ``--redlock-queues`` value, if given.
        consumed: The queues this worker consumes, by name.
        announce: Log the locked queues at INFO (the main process does, once).

    Raises:
        ConfigurationError: Naming the first bad setting, option or queue.
    """
    locks, wrapped = lock_queues(app, cli_queues, consumed)
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
    """Run the lock scripts on every master of the lock store; log and return a summary line.

    What ``celery redlock check`` checks (see :mod:`celery_redlock.core.health`):
    acquire, renew and release under each key prefix in use, on each master of
    a Redlock or a Redis Cluster, the current master of a Sentinel group. Also
    warns about an eviction policy that may drop locks, and about a master with
    fewer replicas connected than ``redlock_min_replicas``. Never raises: a lock
    store that fails at worker start is logged (ERROR), and each task's
    ``on_redis_error`` policy handles it when it runs.
    """
    result = check_store(store_for(app), lock_prefixes(app))
    if not result.ok:
        logger.error("celery-redlock: %s", result.failure())
        return result.summary()
    for node in result.nodes:
        if node.eviction_policy is not None:
            logger.warning(
                "celery-redlock: lock store master %s has maxmemory-policy %s: under memory "
                "pressure it may evict lock keys and let duplicates run; use noeviction",
                node.name,
                node.eviction_policy,
            )
        for problem in node.replica_problems:
            logger.warning("celery-redlock: lock store master %s", problem)
    summary = result.summary()
    logger.info("celery-redlock: %s", summary)
    return summary


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
        logger.warning("celery-redlock: stale-lock recovery skipped: %s", describe_error(exc))
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
    """Worker bootstep of celery-redlock (added by :func:`celery_redlock.celery.install`).

    Receives the ``--redlock-queues`` worker option as ``redlock_queues``,
    ``--redlock-recover/--no-redlock-recover`` as ``redlock_recover_stale``
    (which wins over the setting of that name), and ``--redlock-metrics-port``
    as ``redlock_metrics_port``, validated here with the other operations
    settings before the step touches the lock store.

    Raises:
        ConfigurationError: Naming the bad setting, option or queue. ``celery
            worker`` reports it in one line (see :mod:`celery_redlock.ops.cli`).
    """

    name = "celery-redlock"

    def __init__(
        self,
        worker: Any,
        redlock_queues: str | None = None,
        redlock_recover_stale: bool | None = None,
        redlock_metrics_port: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(worker, **kwargs)
        app = worker.app
        consumed = dict(app.amqp.queues.consume_from)
        self.locks = prepare_worker(app, redlock_queues, consumed)
        # OpsStep, built after this step, uses these; a bad one must stop the
        # worker before the store check and the stale-lock recovery below.
        read_ops_settings(app.conf, redlock_metrics_port)
        recover = flag(app.conf, "redlock_recover_stale", True)
        if redlock_recover_stale is not None:
            if not isinstance(redlock_recover_stale, bool):
                raise ConfigurationError(
                    "--redlock-recover", redlock_recover_stale, "must be True or False"
                )
            recover = redlock_recover_stale
        counting = flag(app.conf, "redlock_stats", True)
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
        control.register()
        logger.debug("celery-redlock: %s command registered", control.STATS_COMMAND)
        self.recovered = recover_at_start(app, worker.hostname) if recover else 0
