"""The locks page's data: one page of locks and reservations, read with ``SCAN`` from every node.

A page is read from a cursor that names where the previous page stopped: the
key prefix, the node (each primary of a Redis Cluster, each Redlock master,
else the one server), the ``SCAN`` cursor of the batch and how many of that
batch's matching keys were already shown. So a page reads only what it shows
(plus what a filter on the holder's queue skips), however many locks the
store holds, and a request never scans more than :data:`SCAN_BUDGET` batches:
a filter that matches little returns a short page with a link to go on.

Each Redlock master holds its own copy of a lock; a key found on a master is
shown only if no earlier master holds it, so each lock is listed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_redlock.core.inventory import LockInfo, glob_escape, lock_pattern, parse_key, read_locks
from celery_redlock.core.keys import KEY_VERSION

__all__ = ["SCAN_BUDGET", "Cursor", "Filters", "Page", "read_page"]

#: Most ``SCAN`` calls one page makes.
SCAN_BUDGET = 50
#: ``SCAN``'s COUNT hint.
SCAN_COUNT = 500


@dataclass(frozen=True)
class Filters:
    """What the locks page shows: every field is a filter when not empty.

    Attributes:
        task: Text the task name contains.
        queue: The queue the holder's task came from (exactly).
        text: Text the key contains.
    """

    task: str = ""
    queue: str = ""
    text: str = ""

    def keeps(self, key: str, task: str) -> bool:
        """Whether a key of ``task`` passes the filters that need no read."""
        return self.task in task and self.text in key

    def keeps_info(self, info: LockInfo) -> bool:
        """Whether a read lock passes the queue filter."""
        if not self.queue:
            return True
        return info.holder is not None and info.holder.queue == self.queue


@dataclass(frozen=True)
class Cursor:
    """Where a page starts.

    Attributes:
        prefix: Index of the key prefix.
        node: Index of the node.
        scan: ``SCAN`` cursor of the batch to read.
        skip: Matching keys of that batch already shown.
    """

    prefix: int = 0
    node: int = 0
    scan: int = 0
    skip: int = 0

    def encode(self) -> str:
        """The cursor as a URL parameter."""
        return f"{self.prefix}.{self.node}.{self.scan}.{self.skip}"

    @classmethod
    def decode(cls, text: str | None) -> Cursor:
        """Read :meth:`encode`'s form; anything else starts from the beginning."""
        parts = (text or "").split(".")
        if len(parts) != 4 or not all(part.isdigit() for part in parts):
            return cls()
        prefix, node, scan, skip = (int(part) for part in parts)
        return cls(prefix, node, scan, skip)


@dataclass
class Page:
    """One page of the locks list.

    Attributes:
        rows: The locks and reservations, in the order found.
        next: The cursor of the next page, ``None`` after the last.
        scans: ``SCAN`` calls made.
    """

    rows: list[LockInfo] = field(default_factory=list)
    next: Cursor | None = None
    scans: int = 0


def _decode(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _pattern(prefix: str, filters: Filters) -> str:
    # lock_pattern(prefix) is "<prefix>:v1:{*:*"; a task filter narrows the
    # task part to names containing it; else a key text lets the server drop
    # every other key (the prefix is checked on the keys that come back).
    if filters.task:
        return f"{glob_escape(prefix)}:{KEY_VERSION}:{{*{glob_escape(filters.task)}*:*"
    if filters.text:
        return f"*{glob_escape(filters.text)}*"
    return lock_pattern(prefix)


def _matching(keys: Sequence[Any], prefix: str, filters: Filters) -> list[str]:
    found = []
    for raw in keys:
        key = _decode(raw)
        parsed = parse_key(key, reservations=True)
        if parsed is not None and parsed[0] == prefix and filters.keeps(key, parsed[1]):
            found.append(key)
    return found


def _first_copies(nodes: Sequence[Any], index: int, keys: list[str]) -> list[str]:
    """Keep the keys that no node before ``index`` holds (Redlock: each lock once)."""
    if index == 0 or not keys:
        return keys
    held = [False] * len(keys)
    for node in nodes[:index]:
        pipe = node.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        for i, found in enumerate(pipe.execute()):
            held[i] = held[i] or bool(found)
    return [key for key, elsewhere in zip(keys, held) if not elsewhere]


def _fill(page: Page, node: Any, keys: list[str], start: int, size: int, filters: Filters) -> int:
    """Read ``keys[start:]`` into ``page`` until it holds ``size`` rows; return where it stopped."""
    position = start
    while position < len(keys) and len(page.rows) < size:
        chunk = keys[position : position + size - len(page.rows)]
        page.rows.extend(
            info for info in read_locks(node, chunk, reservations=True) if filters.keeps_info(info)
        )
        position += len(chunk)
    return position


def read_page(
    nodes: Sequence[Any],
    prefixes: Sequence[str],
    filters: Filters,
    cursor: Cursor,
    size: int,
    budget: int = SCAN_BUDGET,
) -> Page:
    """Read one page of at most ``size`` locks from ``cursor`` on.

    Args:
        nodes: One plain client per node (see ``LockStore.masters``).
        prefixes: The key prefixes to list.
        filters: What to show.
        cursor: Where to start (``Cursor()``: at the beginning).
        size: Most rows.
        budget: Most ``SCAN`` calls.

    Raises:
        redis.exceptions.RedisError: When a node fails.
    """
    page = Page()
    position = _normalized(cursor, len(prefixes), len(nodes))
    while position is not None and len(page.rows) < size and page.scans < budget:
        prefix, node = prefixes[position.prefix], nodes[position.node]
        following, raw = node.scan(
            cursor=position.scan, match=_pattern(prefix, filters), count=SCAN_COUNT
        )
        page.scans += 1
        keys = _first_copies(nodes, position.node, _matching(raw, prefix, filters))
        stopped = _fill(page, node, keys, position.skip, size, filters)
        if stopped < len(keys):
            position = Cursor(position.prefix, position.node, position.scan, stopped)
        elif int(following) == 0:
            position = Cursor(position.prefix, position.node + 1)
        else:
            position = Cursor(position.prefix, position.node, int(following))
        position = _normalized(position, len(prefixes), len(nodes))
    page.next = position
    return page


def _normalized(position: Cursor, prefixes: int, nodes: int) -> Cursor | None:
    """Move a cursor past the last node to the next prefix; ``None`` past the last prefix."""
    while position.prefix < prefixes and position.node >= nodes:
        position = Cursor(position.prefix + 1)
    return position if position.prefix < prefixes else None
