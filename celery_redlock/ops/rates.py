"""Rate keys in the ``celery redlock`` commands: their use in ``list`` and ``show``.

A rate key (``lock_rate``, ``singleton(rate=)``, ``singleton_job(rate=)``) is
shown with its current use against the limit its callers recorded
(``used/limit``), the time until a slot frees and any back-off a call reported
(see :mod:`celery_redlock.core.rate_inventory`). Reading one changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_redlock.core.rate_inventory import RateInfo, find_rates, parse_rate_key, read_rates

from .holders import ttl_text

__all__ = [
    "RATE_HEADER",
    "describe_rate",
    "find_rate_keys",
    "rate_row",
    "read_rate_key",
    "window_text",
]

#: The columns of the rate keys' table in ``list``.
RATE_HEADER = ["TASK", "USED/LIMIT", "WINDOW", "SLOT FREE IN", "BACKED OFF", "KEY"]


def window_text(info: RateInfo) -> str:
    """The window as the rate is written (``1s``, ``60s``), ``-`` when unknown."""
    return "-" if info.window is None else f"{info.window:g}s"


def _free_in(info: RateInfo) -> str:
    return "now" if info.free_in <= 0 else ttl_text(info.free_in)


def rate_row(info: RateInfo) -> list[str]:
    """One row of the rate keys' table."""
    backed = ttl_text(info.backed_off) if info.backed_off > 0 else "-"
    return [info.task, info.usage, window_text(info), _free_in(info), backed, info.key]


def describe_rate(info: RateInfo) -> list[tuple[str, str]]:
    """The (label, value) lines ``show`` prints for a rate key."""
    return [
        ("key", info.key),
        ("task", info.task),
        ("kind", "rate key"),
        ("used/limit", f"{info.usage} starts in the last {window_text(info)}"),
        ("slot free in", _free_in(info)),
        ("backed off", ttl_text(info.backed_off) if info.backed_off > 0 else "-"),
    ]


def find_rate_keys(
    clients: Sequence[Any], prefixes: Sequence[str], task: str | None = None
) -> list[RateInfo]:
    """The rate keys in use under ``prefixes``, each once (the first client holding it)."""
    found: dict[str, RateInfo] = {}
    for client in clients:
        for info in find_rates(client, prefixes, task):
            found.setdefault(info.key, info)
    return sorted(found.values(), key=lambda info: (info.task, info.key))


def read_rate_key(clients: Sequence[Any], key: str) -> RateInfo | None:
    """Read rate key ``key`` (or one of its companions); ``None`` if it is not one, or unused."""
    if parse_rate_key(key) is None:
        return None
    for client in clients:
        found = read_rates(client, [key])
        if found:
            return found[0]
    return None
