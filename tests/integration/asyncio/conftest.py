"""Helpers for the asyncio lock tests: each scenario runs on a fresh event loop.

The suite has no asyncio plugin; ``arun`` runs a coroutine function with an
``redis.asyncio`` client on the test's private server and closes it afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Callable

import pytest
import redis.asyncio


@pytest.fixture
def arun(redis_server):
    """``arun(scenario, **client_kwargs)``: run ``await scenario(client)`` to completion."""

    def run(scenario: Callable[[Any], Awaitable[Any]], **client_kwargs: Any) -> Any:
        async def main() -> Any:
            client = redis.asyncio.Redis.from_url(redis_server.url, **client_kwargs)
            try:
                return await scenario(client)
            finally:
                await client.aclose()

        return asyncio.run(main())

    return run
