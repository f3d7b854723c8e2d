"""``singleton(mode="until_expired")``: once per period for direct calls; queue windows refused."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio

from celery_redlock import ConfigurationError, LockNotAcquired, singleton
from tests.redis_servers import RedisServer

SKIP = object()


@pytest.mark.timeout(20)
def test_until_expired_refuses_duplicates_for_the_period(r: redis.Redis) -> None:
    """An accepted call keeps its key for the period, also after it returned; then it runs again."""
    ran = []

    @singleton(client=r, mode="until_expired", period=1, skipped=SKIP)
    def report(customer: int) -> int:
        ran.append(customer)
        return customer

    accepted = time.monotonic()
    assert report(7) == 7
    assert report(7) is SKIP  # finished, still within its period
    assert report(8) == 8  # another key
    while report(7) is SKIP:
        time.sleep(0.05)
    assert time.monotonic() - accepted >= 1.0
    assert ran == [7, 8, 7]

    @singleton(client=r, mode="until_expired", period=5, on_conflict="raise")
    def strict(customer: int) -> None:
        pass

    strict(1)
    with pytest.raises(LockNotAcquired):
        strict(1)


@pytest.mark.timeout(20)
def test_until_expired_async(redis_server: RedisServer) -> None:
    """The async def side keeps its key for the period too."""

    async def scenario() -> list[int]:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        ran: list[int] = []

        @singleton(client=client, mode="until_expired", period=5, skipped=SKIP)
        async def report(customer: int) -> int:
            ran.append(customer)
            return customer

        assert await report(3) == 3
        assert await report(3) is SKIP
        await client.aclose()
        return ran

    assert asyncio.run(scenario()) == [3]


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ({"mode": "debounce"}, "mode"),
        ({"mode": "until_and_while_executing"}, "mode"),
        ({"mode": "until_expired"}, "period"),
        ({"period": 2}, "period"),
        ({"mode": "until_expired", "period": -1}, "period"),
        ({"mode": "sometimes"}, "mode"),
    ],
)
def test_windows_a_direct_call_cannot_have_are_refused(options: dict, setting: str) -> None:
    """Debounce and the enqueue windows need a queue; a period needs until_expired."""
    with pytest.raises(ConfigurationError) as info:
        singleton(lambda: None, client=redis.Redis(), **options)
    assert info.value.setting == setting
