"""Rate keys as an operator sees them: found with ``SCAN``, read without changing them.

A rate key (``<prefix>:rate:v1:{<name>:<digest>}``, see
:mod:`celery_redlock.core.rate`) has up to two companions in its hash slot:
the back-off key (``:backoff``) and the spec key (``:spec``) recording the
rate its callers use, kept by admissions a little longer than the log. One script reads all three
at once: the starts in the window against the recorded limit, the time until a
slot frees and the back-off left, so ``used/limit`` is shown however the
callers were configured (a Celery task, the decorator, an RQ job). Nothing here
runs on a call's path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .inventory import glob_escape, scan
from .keys import KEY_VERSION
from .lua import Script
from .rate import READ_BLOCKED, READ_USE, rate_keys_of

__all__ = ["RATE_READ", "RateInfo", "find_rates", "parse_rate_key", "rate_pattern", "read_rates"]

_RATE_KEY = re.compile(
    rf"^(?P<prefix>.+):rate:{KEY_VERSION}:\{{(?P<task>.+):(?P<digest>[0-9a-f]{{64}})\}}"
    r"(?::backoff|:spec)?$",
    re.S,
)

# Read one rate key's use, with the limit its callers last recorded.
#
# KEYS[1]  the window's log;  KEYS[2]  the back-off key;  KEYS[3]  the spec key
# Returns  {used, limit, window ms, ms until a slot frees, ms of back-off left,
#          server time ms}; limit and window are 0 when no spec is recorded (nothing
#          started for a window or two). Read-only: safe to resend.
RATE_READ = Script(
    "rate_read",
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local spec = redis.call('GET', KEYS[3])
local limit, window = 0, 0
if spec then
  local l, w = string.match(spec, '^(%d+) (%d+)$')
  limit, window = tonumber(l), tonumber(w)
end
local used, wait = 0, 0
if window > 0 then
"""
    + READ_USE
    + "end\n"
    + READ_BLOCKED
    + "return {used, limit, window, wait, blocked, now}\n",
)


def rate_pattern(prefix: str) -> str:
    """The ``SCAN MATCH`` pattern of the rate keys (and companions) under lock prefix ``prefix``."""
    return f"{glob_escape(prefix)}:rate:{KEY_VERSION}:{{*"


def parse_rate_key(key: str) -> tuple[str, str, str] | None:
    """``(rate key, lock prefix, name)`` of a rate key or a companion; ``None`` for others."""
    match = _RATE_KEY.match(key)
    if match is None:
        return None
    base = key[: match.end("digest") + 1]
    return base, match["prefix"], match["task"]


@dataclass(frozen=True)
class RateInfo:
    """One rate key's current use.

    Attributes:
        key: The rate key.
        task: The task (or function) name in the key.
        used: Starts within the window now.
        limit: Starts the window allows, as the callers recorded it (``None``:
            nothing started for a window or two, so none is recorded).
        window: The window in seconds (``None`` as for ``limit``).
        wait: Seconds until a slot frees (0: one is free now).
        backed_off: Seconds of a back-off left (0: none).
        server_time: The server's clock when read, Unix seconds.
    """

    key: str
    task: str
    used: int
    limit: int | None
    window: float | None
    wait: float
    backed_off: float
    server_time: float

    @property
    def usage(self) -> str:
        """``used/limit`` (``used/?`` when no limit is recorded)."""
        return f"{self.used}/{'?' if self.limit is None else self.limit}"

    @property
    def free_in(self) -> float:
        """Seconds until a call would be admitted: a full window or a back-off, the longer."""
        return max(self.wait, self.backed_off)

    def as_dict(self) -> dict[str, Any]:
        """The rate key as plain JSON-ready data (``kind`` is ``"rate"``)."""
        return {
            "kind": "rate",
            "key": self.key,
            "task": self.task,
            "used": self.used,
            "limit": self.limit,
            "window": self.window,
            "wait": self.wait,
            "backed_off": self.backed_off,
            "server_time": self.server_time,
        }


def read_rates(client: Any, keys: Iterable[str]) -> list[RateInfo]:
    """Read rate keys (or their companions, each key once); keys holding nothing are left out.

    One round trip per key: each is one script over its own hash slot.

    Raises:
        redis.exceptions.RedisError: When the store fails.
    """
    found: list[RateInfo] = []
    seen: set[str] = set()
    for key in keys:
        parsed = parse_rate_key(key)
        if parsed is None or parsed[0] in seen:
            continue
        base, _, task = parsed
        seen.add(base)
        used, limit, window, wait, blocked, now = (
            int(part) for part in RATE_READ(client, rate_keys_of(base), ())
        )
        if not (used or limit or blocked):
            continue
        found.append(
            RateInfo(
                key=base,
                task=task,
                used=used,
                limit=limit or None,
                window=window / 1000 if window else None,
                wait=wait / 1000,
                backed_off=blocked / 1000,
                server_time=now / 1000,
            )
        )
    return found


def find_rates(client: Any, prefixes: Sequence[str], task: str | None = None) -> Iterator[RateInfo]:
    """Yield the rate keys in use under ``prefixes`` (of ``task`` only, if given), via ``SCAN``."""
    for prefix in prefixes:
        keys = [key for key in scan(client, rate_pattern(prefix)) if _of(key, prefix, task)]
        yield from sorted(read_rates(client, keys), key=lambda info: (info.task, info.key))


def _of(key: str, prefix: str, task: str | None) -> bool:
    parsed = parse_rate_key(key)
    return parsed is not None and parsed[1] == prefix and (task is None or parsed[2] == task)
