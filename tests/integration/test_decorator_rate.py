"""singleton(rate=...): per-key rate limits for plain and async functions, on a real Redis."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import redis
import redis.asyncio

from celery_redlock import (
    ConfigurationError,
    RateLimited,
    back_off,
    back_off_async,
    current_rate,
    singleton,
)

pytestmark = pytest.mark.timeout(30)
SKIPPED = object()


def script_calls(r: redis.Redis) -> int:
    """How many scripts the server has run (the private server counts only this test's)."""
    stats = r.info("commandstats")
    return sum(
        int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
    )


def started_at() -> int:
    slot: Any = current_rate()
    return int(slot.verdict.at_ms)


def test_skip_returns_skipped_over_the_limit_per_rate_key(r: redis.Redis) -> None:
    """Two starts per window and rate key: the third call with that key is skipped, others run."""

    @singleton(client=r, rate="2/m", rate_key="account", key="job", skipped=SKIPPED)
    def call(account: str, job: int) -> int:
        return job

    assert [call("a", i) for i in range(3)] == [0, 1, SKIPPED]
    assert call("b", 3) == 3


def test_raise_raises_rate_limited_with_the_wait(r: redis.Redis) -> None:
    """Under "raise" the refused call raises RateLimited saying when a slot frees."""

    @singleton(client=r, rate="1/m", on_conflict="raise")
    def call() -> str:
        return "ran"

    assert call() == "ran"
    with pytest.raises(RateLimited) as refused:
        call()
    assert 55 < refused.value.retry_after <= 60
    assert "rate 1/m" in str(refused.value)


def test_wait_sleeps_until_a_slot_frees_without_polling(r: redis.Redis) -> None:
    """Under "wait" the third call starts one window after the first, asking the limit twice."""
    starts: list[int] = []

    @singleton(client=r, rate="2/1s", on_conflict="wait", wait_timeout=10, wait_sleep=0.05)
    def call() -> None:
        starts.append(started_at())

    call()
    call()
    before = script_calls(r)
    call()
    # A refusal telling the wait, an admission after sleeping it, the lock's
    # acquire and release: 4 scripts (one spare for a wait cut at a millisecond
    # edge). Polling every wait_sleep over the second would be 20 and more.
    assert 4 <= script_calls(r) - before <= 5
    assert starts[2] >= starts[0] + 1000


def test_wait_that_cannot_end_in_time_raises_at_once(r: redis.Redis) -> None:
    """A wait longer than what is left of wait_timeout is refused now, not after sleeping."""

    @singleton(client=r, rate="1/m", on_conflict="wait", wait_timeout=0.5)
    def call() -> None:
        pass

    call()
    with pytest.raises(RateLimited) as refused:
        call()
    assert refused.value.retry_after > 50


def test_back_off_holds_back_every_call_of_the_rate_key(r: redis.Redis) -> None:
    """A call told to slow down blocks its rate key: the next call is refused for that long."""

    @singleton(client=r, rate="100/s", rate_key=[], on_conflict="raise")
    def call(pause: bool) -> None:
        if pause:
            back_off(30)

    call(True)
    with pytest.raises(RateLimited) as refused:
        call(False)
    assert 25 < refused.value.retry_after <= 30


def test_async_functions_are_rate_limited_and_wait_with_asyncio_sleep(redis_server: Any) -> None:
    """async def: skip over the limit; "wait" awaits until a slot frees; back_off_async blocks."""

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        starts: list[int] = []

        @singleton(client=client, rate="2/m", skipped=SKIPPED)
        async def skipper(n: int) -> int:
            return n

        @singleton(client=client, rate="2/0.4s", on_conflict="wait", wait_timeout=10, key=[])
        async def waiter(n: int) -> None:
            starts.append(started_at())

        @singleton(client=client, rate="100/s", on_conflict="raise", key=[])
        async def pauser(pause: bool) -> None:
            if pause:
                await back_off_async(30)

        try:
            assert [await skipper(1), await skipper(1), await skipper(1)] == [1, 1, SKIPPED]
            # A tick of the loop goes on while one call sleeps its wait.
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while len(starts) < 3:
                    ticks += 1
                    await asyncio.sleep(0.01)

            await asyncio.gather(ticker(), waiter(1), waiter(2), waiter(3))
            assert len(starts) == 3 and sorted(starts)[2] >= sorted(starts)[0] + 400
            assert ticks > 3
            await pauser(True)
            with pytest.raises(RateLimited):
                await pauser(False)
        finally:
            await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"rate": "fast"}, "rate"),
        ({"rate": "0/s"}, "rate"),
        ({"rate": "10/s", "rate_key": "missing"}, "rate_key"),
        ({"rate": "10/s", "rate_key": 5}, "rate_key"),
    ],
)
def test_bad_rate_options_fail_at_decoration_naming_the_option(
    r: redis.Redis, options: dict[str, Any], named: str
) -> None:
    """A bad rate or rate key is a ConfigurationError naming the option, before any call."""

    def call(account: str) -> None:
        pass

    with pytest.raises(ConfigurationError) as bad:
        singleton(call, client=r, **options)
    assert bad.value.setting.split(".")[-1] == named


def test_wait_takes_the_lock_before_the_rate_slot_so_starts_follow_admissions(
    r: redis.Redis,
) -> None:
    """Under "wait" a call waiting for its lock is admitted only once it holds it.

    Admitted first, a call that then waited for a long-running duplicate would
    start a window after its admission, and later admissions could put more
    starts than the rate into one window. Checked by order, on the server's
    clock: each run's admission comes after the previous run ended.
    """
    runs: list[tuple[int, int, int]] = []  # (admitted, started, ended), server ms

    def now_ms() -> int:
        seconds, micros = r.time()
        return int(seconds) * 1000 + int(micros) // 1000

    @singleton(client=r, rate="2/1s", on_conflict="wait", wait_timeout=20, key=[])
    def call(seconds: float) -> None:
        started = now_ms()
        running.set()
        time.sleep(seconds)
        runs.append((started_at(), started, now_ms()))

    running = threading.Event()
    first = threading.Thread(target=call, args=(0.9,))
    first.start()
    assert running.wait(10)  # the long call holds the lock before the others come
    others = [threading.Thread(target=call, args=(0.05,)) for _ in range(3)]
    for thread in others:
        thread.start()
    for thread in [first, *others]:
        thread.join(timeout=20)
    runs.sort(key=lambda run: run[1])
    assert len(runs) == 4
    for before, after in zip(runs, runs[1:]):
        assert after[0] >= before[2], f"admitted while the previous run was running: {runs}"
