"""Stale-lock recovery: a restarted worker frees the locks and permits its previous run left.

A worker killed outright (``kill -9``, OOM, power loss of a container) leaves
its locks to expire with their TTL. When a worker starts it knows who it was:
its node name and host. A lock whose value names that node and host, and a
process that no longer exists there, can only belong to a dead earlier
incarnation, so it is deleted at once, with a compare-and-delete of the exact
value read, so a lock taken again meanwhile stays. A semaphore's permits
(``lock_limit`` above 1) are judged one by one on the same rule, and each is
removed alone (:func:`~celery_redlock.core.reclaim.delete_permit`): the
semaphore's other holders keep theirs. Locks of any other node or
host, of a live process, or whose value does not record its host (format
``v1``) are never touched: they expire on their own. Nor are values without
a TTL: only a running task's execution lock records its TTL, while an enqueue
lock (``lock_mode``) names the process that *published* the task, whose exit
says nothing about the queued message.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from .holder import Holder
from .inventory import LockInfo, PermitInfo, find_locks
from .reclaim import delete_permit, reap_lock

__all__ = ["lock_prefixes", "pid_alive", "recover_stale", "stale_for"]

logger = logging.getLogger(__name__)

#: The default ``redlock_key_prefix`` (see :class:`celery_redlock.calls.options.LockOptions`).
DEFAULT_PREFIX = "redlock"


def pid_alive(pid: int) -> bool:
    """Return ``True`` if a process ``pid`` exists on this machine and has not exited.

    A process of another user counts as alive. So does a pid reused by an
    unrelated process, which errs on the safe side: the lock is left to expire.
    A zombie (exited, not yet reaped by its parent: a killed pool process whose
    worker died with it) is dead: it runs no code and holds nothing.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (Linux ``/proc``; ``False`` elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) state ...": comm may hold spaces and parentheses.
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def lock_prefixes(app: Any) -> list[str]:
    """Return every key prefix the locks of ``app`` can use, the app-wide one first.

    That is ``redlock_key_prefix`` (or its default), the ``key_prefix`` of each
    ``redlock_queues`` entry and the ``lock_key_prefix`` of each task.
    """
    conf = app.conf
    prefixes = [conf.get("redlock_key_prefix") or DEFAULT_PREFIX]
    queues = conf.get("redlock_queues")
    if isinstance(queues, dict):
        for options in queues.values():
            if isinstance(options, dict) and isinstance(options.get("key_prefix"), str):
                prefixes.append(options["key_prefix"])
    for task in list(app.tasks.values()):
        prefix = getattr(task, "lock_key_prefix", None)
        if isinstance(prefix, str) and prefix:
            prefixes.append(prefix)
    return list(dict.fromkeys(prefixes))


def stale_for(
    info: LockInfo | PermitInfo, node: str, host: str, alive: Callable[[int], bool] = pid_alive
) -> bool:
    """``True`` if lock or permit ``info`` was left by a dead process of ``node`` on ``host``."""
    holder = info.holder
    if holder is None or holder.host is None or not holder.ttl_ms:
        return False
    return holder.hostname == node and holder.host == host and not alive(holder.pid)


def recover_stale(
    client: Any,
    prefixes: Iterable[str],
    node: str,
    host: str | None = None,
    alive: Callable[[int], bool] = pid_alive,
) -> list[LockInfo]:
    """Delete the locks and permits a dead earlier run of worker ``node`` left; return them.

    A permit comes back as its semaphore with that one permit in ``permits``.

    Args:
        client: The lock store.
        prefixes: Key prefixes to scan (see :func:`lock_prefixes`).
        node: This worker's node name.
        host: This machine's host name (default: ``socket.gethostname()``).
        alive: Tells whether a pid on this machine is alive.

    Raises:
        redis.exceptions.RedisError: If the lock store fails.
    """
    host = host or socket.gethostname()
    released: list[LockInfo] = []
    for info in find_locks(client, prefixes, semaphores=True):
        if info.permits is not None:
            released += _recover_permits(client, info, node, host, alive)
        elif stale_for(info, node, host, alive) and reap_lock(client, info):
            assert info.holder is not None
            _log(f"lock {info.key}", info.task, info.holder, node, info.fence)
            released.append(info)
    return released


def _recover_permits(
    client: Any, info: LockInfo, node: str, host: str, alive: Callable[[int], bool]
) -> list[LockInfo]:
    released = []
    for permit in info.permits or ():
        if stale_for(permit, node, host, alive) and delete_permit(client, info, permit):
            assert permit.holder is not None
            what = f"permit {permit.slot} of semaphore {info.key}"
            _log(what, info.task, permit.holder, node, permit.fence)
            released.append(replace(info, permits=(permit,)))
    return released


def _log(what: str, task: str, holder: Holder, node: str, fence: int | None) -> None:
    logger.warning(
        "celery-redlock: released stale %s of task %s[%s] (pid %d of an earlier run of %s "
        "is gone; fence %s)",
        what,
        task,
        holder.task_id,
        holder.pid,
        node,
        fence,
    )
