"""The lock page's data: one key as every node holds it, its holder's state, its related keys.

What the store keeps about a key besides the lock itself is little: the fence
counter it draws from (shared by the store, or by the key's slot on Cluster:
the latest fence drawn there; every acquisition draws the next one) and, for
the enqueue windows, the reservation beside the lock. Both are shown. The
holder's state comes from Celery: the task's state in the result backend,
and whether its worker answers a ping (with, on this host, whether its pid
runs), as ``celery redlock release`` checks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_redlock.core.fences import fence_key_for, is_cluster
from celery_redlock.core.inventory import RESERVATION_SUFFIX, LockInfo, read_locks
from celery_redlock.ops.commands import Liveness, holder_liveness

__all__ = ["Detail", "Related", "read_copies", "read_detail", "task_state"]


@dataclass(frozen=True)
class Related:
    """A key the store keeps beside a lock.

    Attributes:
        label: What it is.
        key: The key.
        value: Its value (``None``: absent).
        ttl: Seconds it has left (``None``: absent or no expiry).
    """

    label: str
    key: str
    value: str | None
    ttl: float | None


@dataclass(frozen=True)
class Detail:
    """One lock as the lock page shows it.

    Attributes:
        info: The lock as the first node holding it has it.
        holders: Per node (its index), whether it holds the same value.
        task_state: The holder's task state in the result backend, or why unknown.
        liveness: Whether the holder is alive, and how that was found out.
        related: The fence counter and the reservation or lock beside it.
    """

    info: LockInfo
    holders: list[tuple[int, bool]]
    task_state: str
    liveness: Liveness
    related: list[Related]


def read_copies(nodes: Sequence[Any], key: str) -> list[LockInfo | None]:
    """Read ``key`` on every node (``None`` where it is absent).

    Raises:
        redis.exceptions.RedisError: When a node fails.
    """
    copies: list[LockInfo | None] = []
    for node in nodes:
        found = read_locks(node, [key], reservations=True)
        copies.append(found[0] if found else None)
    return copies


def task_state(app: Any, task_id: str) -> str:
    """The task's state in ``app``'s result backend, or a sentence saying why it is unknown."""
    try:
        return str(app.AsyncResult(task_id).state)
    except Exception as exc:  # no backend, backend down, disabled backend
        return f"unknown ({exc.__class__.__name__}: {exc})"


def _related(node: Any, info: LockInfo) -> list[Related]:
    lock_key = info.key.removesuffix(RESERVATION_SUFFIX)
    fence_key = fence_key_for(lock_key, cluster=is_cluster(node))
    keys: list[tuple[str, str]] = [("fence counter", fence_key)]
    if info.kind == "reservation":
        keys.append(("lock", lock_key))
    else:
        keys.append(("enqueue reservation", lock_key + RESERVATION_SUFFIX))
    pipe = node.pipeline(transaction=False)
    for _, key in keys:
        pipe.get(key)
        pipe.pttl(key)
    replies = pipe.execute()
    related = []
    for i, (label, key) in enumerate(keys):
        raw, pttl = replies[2 * i], replies[2 * i + 1]  # the clients answer bytes
        value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else None
        ttl = pttl / 1000 if isinstance(pttl, int) and pttl >= 0 else None
        related.append(Related(label, key, value, ttl))
    return related


def read_detail(app: Any, nodes: Sequence[Any], key: str, ping_timeout: float) -> Detail | None:
    """Read everything the lock page shows about ``key``; ``None`` when no node holds it.

    Raises:
        redis.exceptions.RedisError: When a node fails.
    """
    copies = read_copies(nodes, key)
    first = next((i for i, copy in enumerate(copies) if copy is not None), None)
    if first is None:
        return None
    info = copies[first]
    assert info is not None
    holder = info.holder
    if info.kind == "reservation":
        liveness = Liveness(None, "a reservation names the publishing process, not a running task")
    else:
        liveness = holder_liveness(app, holder, ping_timeout)
    return Detail(
        info=info,
        holders=[
            (i, copy is not None and copy.value == info.value) for i, copy in enumerate(copies)
        ],
        task_state=task_state(app, holder.task_id) if holder is not None else "-",
        liveness=liveness,
        related=_related(nodes[first], info),
    )
