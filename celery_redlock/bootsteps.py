"""Worker start: validate the configuration, check the lock store, turn on per-queue locking.

:class:`RedlockStep` is a worker bootstep. Its constructor runs in the main
process before the pool starts, which is what per-queue locking needs: it
wraps the plain tasks' bodies before the pool builds the tracers that capture
them, and prefork children inherit the wrapped tasks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery import bootsteps
from redis.exceptions import RedisError

from .conf import check_settings, parse_queues
from .exceptions import ConfigurationError
from .queues import QueueLocks, lock_plain_tasks, register
from .store import redact_url, store_for

__all__ = ["RedlockStep", "check_lock_store", "prepare_worker"]

logger = logging.getLogger(__name__)

#: Eviction policies under which Redis never drops keys to free memory.
_SAFE_POLICIES = ("noeviction",)


def prepare_worker(app: Any, cli_queues: str | None, consumed: Mapping[str, Any]) -> QueueLocks:
    """Validate every redlock setting and set up per-queue locking for one worker.

    Args:
        app: The worker's app.
        cli_queues: The ``--redlock-queues`` value, if given.
        consumed: The queues this worker consumes, by name.

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
    locks = QueueLocks(
        {name: queues[name] for name in queues if name in consumed}, consumed.values()
    )
    register(app, locks)
    wrapped = lock_plain_tasks(app) if locks.locked else 0
    if locks.locked:
        logger.info(
            "celery-redlock: locking tasks from queue(s) %s (%d plain task(s) wrapped)",
            ", ".join(sorted(locks.locked)),
            wrapped,
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
    if not versions:
        return f"lock store {address} is unreachable: {'; '.join(problems)}"
    summary = f"lock store {address} (Redis {', '.join(sorted(set(versions)))}) answers"
    if problems:
        summary += "; " + "; ".join(problems)
    logger.info("celery-redlock: %s", summary)
    return summary


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


class RedlockStep(bootsteps.Step):  # type: ignore[misc]  # celery ships no type hints
    """Worker bootstep of celery-redlock (added by :func:`celery_redlock.install`).

    Receives the ``--redlock-queues`` worker option as ``redlock_queues``.
    A configuration error stops a command-line worker with one line naming
    the setting and value; a programmatic worker gets the ``ConfigurationError``.
    """

    name = "celery-redlock"

    def __init__(self, worker: Any, redlock_queues: str | None = None, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        app = worker.app
        try:
            self.locks = prepare_worker(app, redlock_queues, dict(app.amqp.queues.consume_from))
        except ConfigurationError as exc:
            from celery.apps.worker import Worker as CommandLineWorker

            if isinstance(worker, CommandLineWorker):
                raise SystemExit(f"celery-redlock: configuration error: {exc}") from None
            raise
        check_lock_store(app)
