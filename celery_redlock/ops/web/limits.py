"""The locks page's second part: semaphores permit by permit, and rate keys with their use.

Semaphores (``lock_limit`` above 1) and rate keys (``lock_rate``) are read on
the first page of the list only, each kind by a ``SCAN`` whose pattern names
its keys (a permits set ends in ``:permits``, a rate key lies under
``<prefix>:rate:``), and at most ``limit`` rows of each are shown. The page's
filters apply: task and key text to both, the queue to the permits' holders
(a rate key has no holder, so a queue filter hides the rate keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_redlock.core.inventory import (
    PERMITS_SUFFIX,
    glob_escape,
    lock_pattern,
    parse_key,
    read_locks,
    scan,
)
from celery_redlock.core.rate_inventory import RateInfo, parse_rate_key, rate_pattern, read_rates

from .listing import Filters

__all__ = ["Limits", "read_limits"]


@dataclass
class Limits:
    """The semaphores' permits and the rate keys a page shows.

    Attributes:
        permits: One row per live permit (task, key, slot, holder, fence, TTL).
        rates: One row per rate key in use (task, key, used/limit, waits).
        more: Some rows were left out (more than the page's limit).
    """

    permits: list[dict[str, Any]] = field(default_factory=list)
    rates: list[dict[str, Any]] = field(default_factory=list)
    more: bool = False


def _digest(key: str) -> str:
    # "<prefix>:...:{<task>:<digest>}": the first characters of the digest.
    return key[: key.rindex("}")].rsplit(":", 1)[-1][:12]


def _permit_rows(node: Any, prefix: str, filters: Filters) -> list[dict[str, Any]]:
    pattern = lock_pattern(prefix) + glob_escape(PERMITS_SUFFIX)
    keys = []
    for key in scan(node, pattern):
        parsed = parse_key(key, semaphores=True)
        if parsed is not None and parsed[0] == prefix and filters.keeps(key, parsed[1]):
            keys.append(key)
    rows = []
    for info in read_locks(node, keys, semaphores=True):
        for permit in info.permits or ():
            holder = permit.holder
            if filters.queue and (holder is None or holder.queue != filters.queue):
                continue
            rows.append(
                {
                    "key": info.key,
                    "task": info.task,
                    "digest": _digest(info.key),
                    "slot": permit.slot,
                    "task_id": holder.task_id if holder else permit.token,
                    "node": holder.hostname if holder else "?",
                    "pid": holder.pid if holder else "?",
                    "fence": permit.fence,
                    "ttl": permit.ttl,
                }
            )
    return rows


def _rate_row(info: RateInfo) -> dict[str, Any]:
    share = info.used / info.limit if info.limit else 0.0
    return {
        "key": info.key,
        "task": info.task,
        "digest": _digest(info.key),
        "usage": info.usage,
        "share": min(1.0, share),
        "window": "-" if info.window is None else f"{info.window:g}s",
        "free_in": info.free_in,
        "backed_off": info.backed_off,
    }


#: Rate keys read per batch on the page (one round trip each).
_RATE_BATCH = 50


def _rate_rows(node: Any, prefix: str, filters: Filters, limit: int) -> list[dict[str, Any]]:
    """The rows of the rate keys under ``prefix`` that pass ``filters``.

    Keys are filtered by name before any is read, and reading stops past
    ``limit`` rows in use (enough to tell that there are more), however many
    rate keys the store holds.
    """
    bases: dict[str, None] = {}
    for key in scan(node, rate_pattern(prefix)):
        parsed = parse_rate_key(key)
        if parsed is not None and parsed[1] == prefix and filters.keeps(parsed[0], parsed[2]):
            bases[parsed[0]] = None
    names, rows = list(bases), []
    for start in range(0, len(names), _RATE_BATCH):
        rows += [_rate_row(info) for info in read_rates(node, names[start : start + _RATE_BATCH])]
        if len(rows) > limit:
            break
    return rows


def read_limits(
    nodes: Sequence[Any], prefixes: Sequence[str], filters: Filters, limit: int
) -> Limits:
    """Read the permits and rate keys under ``prefixes`` that pass ``filters``.

    Semaphores and rate keys live on one server (or a Cluster, or Sentinel's
    master), never on Redlock masters, so each is read once from the node holding it.

    Raises:
        redis.exceptions.RedisError: When a node fails.
    """
    found = Limits()
    seen: set[str] = set()
    for node in nodes:
        for prefix in prefixes:
            permits = [row for row in _permit_rows(node, prefix, filters) if row["key"] not in seen]
            found.permits += permits
            seen.update(row["key"] for row in permits)
            if filters.queue:
                continue
            rates = _rate_rows(node, prefix, filters, limit)
            rates = [row for row in rates if row["key"] not in seen]
            found.rates += rates
            seen.update(row["key"] for row in rates)
    found.permits.sort(key=lambda row: (row["task"], row["key"], row["slot"]))
    found.rates.sort(key=lambda row: (row["task"], row["key"]))
    found.more = len(found.permits) > limit or len(found.rates) > limit
    found.permits, found.rates = found.permits[:limit], found.rates[:limit]
    return found
