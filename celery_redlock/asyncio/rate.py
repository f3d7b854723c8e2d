"""The asyncio twin of :class:`celery_redlock.core.rate.RateLimiter`, for ``redis.asyncio``.

The same scripts, keys and replies as the core limiter; only the round trips
are awaited. A rate key is shared between sync and async callers.
"""

from __future__ import annotations

from typing import Any

from celery_redlock.core.rate import (
    BACK_OFF,
    RATE_ACQUIRE,
    RATE_REFUND,
    Rate,
    RateVerdict,
    backoff_key,
    new_member,
    rate_keys_of,
    verdict_of,
)

from .scripts import run_script

__all__ = ["RateLimiter"]


class RateLimiter:
    """Admits calls to rate keys on one ``redis.asyncio`` client.

    Args:
        client: A ``redis.asyncio`` client.
        rate: The rate every key of this limiter allows.
    """

    def __init__(self, client: Any, rate: Rate) -> None:
        self.client = client
        self.rate = rate
        self.args = (rate.limit, rate.window_ms)

    async def acquire(self, key: str, call_id: str | None = None) -> RateVerdict:
        """Admit a call to ``key`` now, or say how long until it can be: one round trip.

        Raises:
            redis.exceptions.RedisError: When the store fails.
        """
        member = new_member(call_id)
        reply = await run_script(
            RATE_ACQUIRE, self.client, rate_keys_of(key), (*self.args, member, "0")
        )
        return verdict_of(reply, self.rate, member)

    async def refund(self, key: str, verdict: RateVerdict) -> None:
        """Take back an admission whose call did not start (raises ``RedisError``)."""
        if verdict.admitted:
            await run_script(RATE_REFUND, self.client, (key,), (verdict.member,))

    async def back_off(self, key: str, seconds: float) -> float:
        """Refuse every call of ``key`` for ``seconds``; return how long the block lasts.

        Raises:
            ValueError: If ``seconds`` is not positive.
            redis.exceptions.RedisError: When the store fails.
        """
        if not seconds > 0:
            raise ValueError(f"back_off needs a positive number of seconds, not {seconds!r}")
        ms = max(1, round(seconds * 1000))
        return int(await run_script(BACK_OFF, self.client, (backoff_key(key),), (ms,))) / 1000
