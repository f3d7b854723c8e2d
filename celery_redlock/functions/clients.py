"""Where a decorated function's lock gets its Redis client: given, from a factory or a URL."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Union

import redis

from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.store import redact_url

__all__ = ["ClientResolver", "ClientSource"]

#: A client, or a function of no arguments returning one (called on every call).
ClientSource = Union[Any, Callable[[], Any]]


def _check_url(url: object) -> None:
    """Read ``url`` as redis-py will on the first call, so a bad one fails at decoration.

    Raises:
        ConfigurationError: Naming ``url`` (password masked) and redis-py's reason.
    """
    if not isinstance(url, str):
        raise ConfigurationError("url", url, "must be a redis://, rediss:// or unix:// URL")
    try:
        redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigurationError("url", redact_url(url), str(exc)) from None


class ClientResolver:
    """Where a decorated function gets its Redis client from, resolved on each call.

    A URL gives one client per process for plain functions (a forked child must
    not share its parent's sockets). For ``async def`` functions it gives a
    client per call, closed afterwards: ``redis.asyncio`` connections belong to
    the loop that opened them and must be closed on it; pass ``client=`` (or a
    factory) to reuse connections across calls.
    """

    def __init__(self, client: ClientSource | None, url: str | None) -> None:
        if (client is None) == (url is None):
            raise ConfigurationError(
                "client", client, "give exactly one of client= (a client or a factory) and url="
            )
        if url is not None:
            _check_url(url)
        self._client = client
        self._url = url
        self._by_pid: tuple[int, Any] | None = None

    def get(self) -> Any:
        """Return the client for a call of a plain function."""
        if self._client is not None:
            return self._given()
        if self._by_pid is None or self._by_pid[0] != os.getpid():
            assert self._url is not None
            self._by_pid = (os.getpid(), redis.Redis.from_url(self._url))
        return self._by_pid[1]

    def get_async(self) -> tuple[Any, bool]:
        """Return the client for a call of an ``async def`` function, and whether to close it."""
        if self._client is not None:
            return self._given(), False
        from redis import asyncio as redis_asyncio

        assert self._url is not None
        return redis_asyncio.Redis.from_url(self._url), True

    def _given(self) -> Any:
        if callable(self._client) and not hasattr(self._client, "execute_command"):
            return self._client()
        return self._client
