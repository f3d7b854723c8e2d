"""Where fences are drawn: one counter per key prefix, or one per prefix and hash slot on Cluster.

Every acquisition (a lock, a semaphore permit, an enqueue handover) draws its
fence from a counter in the same script that takes the lock, so the counter
must live in the lock key's Redis Cluster hash slot. One counter per name did
that, but left a key behind for every name ever locked. A counter shared by
every name of a prefix (``myapp:v1:fence`` for the task locks
``myapp:v1:{...}``) keeps the store at one key per prefix (per prefix and slot
in use on Cluster), stays inside the prefix an ACL grants, and, since it only
grows, still gives each name strictly increasing fences. See
``scripts.ACQUIRE`` for why fences also keep increasing when the counter
itself is lost.

On Cluster the counter of a slot is ``<counter>:{<tag>}``, where ``<tag>`` is
the shortest decimal number that hashes to that slot; the table of tags is
built on first use (about 170,000 CRC16 computations, a few tens of ms, once per
process).
"""

from __future__ import annotations

import binascii
import threading
from typing import Any, overload

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

__all__ = ["FENCE_COUNTER", "counter_for", "fence_key_for", "is_cluster", "slot_tag"]

#: The fence counter of names without a prefix (see :func:`counter_for`).
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


def counter_for(name: str) -> str:
    """Return the store-wide fence counter of the names that share ``name``'s prefix.

    The counter lives beside the lock, under the same prefix: the part of the
    name before its hash tag (``myapp:v1:`` for ``myapp:v1:{task:hash}``), or
    before its last colon, followed by ``fence``. A user whose ACL admits only
    the locks' prefix can then draw fences. A name with neither (``"report"``)
    draws from :data:`FENCE_COUNTER`.
    """
    brace = name.find("{")
    head = name[:brace] if brace >= 0 else name[: name.rfind(":") + 1]
    if not head:
        return FENCE_COUNTER
    counter = f"{head}fence" if head.endswith(":") else f"{head}:fence"
    return counter if counter != name else f"{name}:fence"  # a lock named like a counter


@overload
def fence_key_for(name: str, *, cluster: bool = False) -> str: ...
@overload
def fence_key_for(name: bytes, *, cluster: bool = False) -> bytes: ...
def fence_key_for(name: str | bytes, *, cluster: bool = False) -> str | bytes:
    """Return the key of the fence counter that lock ``name`` draws from.

    Outside Cluster a name draws from its prefix's counter (see
    :func:`counter_for`). On Redis Cluster (``cluster=True``) it draws from
    that counter's copy in its own hash slot, because the acquire script
    touches both keys. Bytes names (which redis-py accepts) give a bytes key.
    """
    # latin-1 maps every byte to one character and back, so a bytes name's
    # prefix survives whatever its encoding.
    text = name.decode("latin-1") if isinstance(name, bytes) else name
    key = counter_for(text)
    if cluster:
        raw = name if isinstance(name, bytes) else name.encode("utf-8")
        key = f"{key}:{{{slot_tag(key_slot(raw))}}}"
    return key.encode("latin-1") if isinstance(name, bytes) else key
