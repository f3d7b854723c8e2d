"""singleton(limit=N): up to N calls per key at once, for plain and async functions."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis
import redis.asyncio

from celery_redlock import current_lock, singleton

pytestmark = pytest.mark.timeout(30)
SKIPPED = object()


class Crowd:
    """Counts the calls inside at once, the most seen, and the fences and slots they held."""

    def __init__(self) -> None:
        self.guard = threading.Lock()
        self.inside = 0
        self.most = 0
        self.fences: list[int] = []
        self.slots: set[int] = set()

    def enter(self) -> None:
        lease: Any = current_lock()
        with self.guard:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.fences.append(lease.fence)
            self.slots.add(lease.slot)

    def leave(self) -> None:
        with self.guard:
            self.inside -= 1


def test_skip_lets_limit_calls_in_and_skips_the_rest(r: redis.Redis) -> None:
    """Five calls with one key while three hold their permits: three run, two are skipped."""
    crowd, release = Crowd(), threading.Event()
    entered = threading.Semaphore(0)

    @singleton(client=r, limit=3, ttl=5, skipped=SKIPPED)
    def job(key: str) -> str:
        if key != "k":
            return key
        crowd.enter()
        entered.release()
        assert release.wait(10)
        crowd.leave()
        return key

    threads = [threading.Thread(target=job, args=("k",)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert entered.acquire(timeout=10)
    assert job("k") is SKIPPED and job("k") is SKIPPED
    assert job("other") == "other"  # another key has permits of its own
    release.set()
    for thread in threads:
        thread.join(10)
    assert crowd.most == 3 and crowd.slots == {0, 1, 2}


def test_wait_runs_every_call_never_more_than_limit_at_once(r: redis.Redis) -> None:
    """Twelve threads, limit 2, on_conflict="wait": all run, two at a time at most, fences
    all distinct."""
    crowd = Crowd()

    @singleton(client=r, limit=2, ttl=5, on_conflict="wait", wait_timeout=20, wait_sleep=0.2)
    def job(key: str) -> None:
        crowd.enter()
        threading.Event().wait(0.02)
        crowd.leave()

    threads = [threading.Thread(target=job, args=("k",)) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(25)
    assert len(crowd.fences) == len(set(crowd.fences)) == 12
    assert crowd.most == 2


def test_async_functions_take_an_asyncio_permit(redis_server: Any) -> None:
    """An async def with limit=2 under wait: tasks of one loop share two permits."""
    crowd = Crowd()

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_server.url)

        @singleton(client=client, limit=2, ttl=5, on_conflict="wait", wait_timeout=20)
        async def job(key: str) -> None:
            crowd.enter()
            await asyncio.sleep(0.02)
            crowd.leave()

        try:
            await asyncio.gather(*(job("k") for _ in range(6)))
        finally:
            await client.aclose()

    asyncio.run(main())
    assert crowd.most == 2 and len(set(crowd.fences)) == 6
