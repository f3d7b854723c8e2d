"""Where fences are drawn: one counter per lock store, or one per hash slot on Redis Cluster.

Every acquisition (a lock, a semaphore permit, an enqueue handover) draws its
fence from a counter in the same script that takes the lock, so the counter
must live in the lock key's Redis Cluster hash slot. One counter per name did
that, but left a key behind for every name ever locked. A counter shared by
every name keeps the store at one key (one per slot in use on Cluster), and a
shared counter that only grows still gives each name strictly increasing
fences. See ``scripts.ACQUIRE`` for why fences also keep increasing when the
counter itself is lost.

On Cluster the counter of a slot is ``redlock:fence:{<tag>}``, where ``<tag>``
is the shortest decimal number that hashes to that slot; the table of tags is
built on first use (about 170,000 CRC16 computations, a few tens of ms, once per
process).
"""

from __future__ import annotations

import binascii
import threading
from typing import Any, overload

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

__all__ = ["FENCE_COUNTER", "fence_key_for", "is_cluster", "slot_tag"]

#: The fence counter of a store that is not a Redis Cluster.
FENCE_COUNTER = "redlock:fence"

_tags: list[str] | None = None
_tags_built = threading.Lock()


def _build_tags() -> list[str]:
    # The smallest decimal number per slot: enumerate until every slot has one
    # (a coupon collector over 16,384 slots; about 170,000 numbers).
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    missing = REDIS_CLUSTER_HASH_SLOTS
    number = 0
    while missing:
        text = str(number)
        slot = binascii.crc_hqx(text.encode("ascii"), 0) % REDIS_CLUSTER_HASH_SLOTS
        if tags[slot] is None:
            tags[slot] = text
            missing -= 1
        number += 1
    return [tag for tag in tags if tag is not None]


def slot_tag(slot: int) -> str:
    """Return a hash tag (a decimal number) whose keys live in Redis Cluster slot ``slot``."""
    global _tags
    tags = _tags
    if tags is None:
        with _tags_built:
            if _tags is None:
                _tags = _build_tags()
            tags = _tags
    return tags[slot]


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a Redis Cluster client (sync or asyncio), whose keys have slots."""
    return getattr(client, "nodes_manager", None) is not None


@overload
def fence_key_for(name: str, *, cluster: bool = False) -> str: ...
@overload
def fence_key_for(name: bytes, *, cluster: bool = False) -> bytes: ...
def fence_key_for(name: str | bytes, *, cluster: bool = False) -> str | bytes:
    """Return the key of the fence counter that lock ``name`` draws from.

    Outside Cluster every name draws from :data:`FENCE_COUNTER`. On Redis
    Cluster (``cluster=True``) a name draws from the counter of its hash slot,
    whose key shares that slot, because the acquire script touches both. Bytes
    names (which redis-py accepts) give a bytes key.
    """
    if not cluster:
        return FENCE_COUNTER.encode() if isinstance(name, bytes) else FENCE_COUNTER
    raw = name if isinstance(name, bytes) else name.encode("utf-8")
    key = f"{FENCE_COUNTER}:{{{slot_tag(key_slot(raw))}}}"
    return key.encode() if isinstance(name, bytes) else key
