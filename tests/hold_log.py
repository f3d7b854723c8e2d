"""Checks that contenders held a lock one at a time, and a way to run forked contenders.

A hold is ``(start, end, holders, fence)``: when it began and ended, how many
contenders were inside at its start (a shared counter), and its fence. Protected
calls that cannot return their holds (decorated functions, RQ jobs) push them to
a Redis list as ``start:end:holders:fence`` instead.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from typing import Any, Callable

Hold = tuple[float, float, int, int]


def assert_serial_holds(holds: Sequence[Hold], count: int) -> None:
    """Assert there are ``count`` holds, one contender inside at a time, fences rising."""
    ordered = sorted(holds)
    assert len(ordered) == count
    assert {holders for _, _, holders, _ in ordered} == {1}, "another contender was inside"
    for (_, end, *_), (start, *_) in zip(ordered, ordered[1:]):
        assert end <= start, "two holders overlapped"
    fences = [fence for *_, fence in ordered]
    assert fences == sorted(set(fences)), "fences did not rise in hold order"


def fences_drawn_for(lock: Any, seconds: float, pause: float = 0.02) -> list[int]:
    """Take and release ``lock`` every ``pause`` seconds for ``seconds``; return its fences."""
    fences = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
        time.sleep(pause)
    return fences


def assert_serial(client: Any, key: str, count: int) -> None:
    """:func:`assert_serial_holds` for the holds logged under ``key`` in Redis."""
    entries = [entry.decode().split(":") for entry in client.lrange(key, 0, -1)]
    assert_serial_holds([(float(s), float(e), int(h), int(f)) for s, e, h, f in entries], count)


def run_contenders(target: Callable[..., None], count: int, *args: Any) -> list[Hold]:
    """Fork ``count`` processes running ``target(*args, results)``; return all their holds.

    ``target`` puts ``("ok", holds)`` or ``("error", detail)`` on ``results``;
    any error fails the caller with its detail.
    """
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    processes = [ctx.Process(target=target, args=(*args, results)) for _ in range(count)]
    for process in processes:
        process.start()
    reports = [results.get(timeout=100) for _ in processes]
    for process in processes:
        process.join(timeout=10)
    errors = [detail for status, detail in reports if status == "error"]
    assert not errors
    return [hold for _, detail in reports for hold in detail]
