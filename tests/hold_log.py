"""A log of lock holds kept in a Redis list, and the check that no two holds overlapped.

Each protected call (a decorated function, an RQ job) pushes one entry
``start:end:holders:fence``: wall-clock start and end of its hold, how many
callers were inside at its start (a shared counter), and its fence.
"""

from __future__ import annotations

from typing import Any


def assert_serial(client: Any, key: str, count: int) -> None:
    """Assert the ``count`` holds logged under ``key`` ran one at a time, fences rising."""
    entries = [entry.decode().split(":") for entry in client.lrange(key, 0, -1)]
    holds = sorted((float(s), float(e), int(h), int(f)) for s, e, h, f in entries)
    assert len(holds) == count
    assert {holders for _, _, holders, _ in holds} == {1}, "another caller was inside"
    for (_, end, *_), (start, *_) in zip(holds, holds[1:]):
        assert end <= start, "two holds overlapped"
    fences = [fence for *_, fence in holds]
    assert fences == sorted(set(fences)), "fences did not rise in hold order"
