"""Debounce when its lock store restarts empty mid-burst (a private redis-server as the store).

The generation hash is lost with the store. Messages published before the
restart then either meet a new hash (calls after the restart made one: they
are older, so they retire) or none (they register themselves and wait one
quiet time, so the newest of them wins): at most one run more than without
the restart, and the newest call always runs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
import redis
from celery import Celery

from tests.celery_apps import storm, windows
from tests.celery_harness import REDIS_URL, Broker
from tests.redis_servers import RedisServer

if TYPE_CHECKING:
    from tests.integration.celery.conftest import WorkerFactory


@pytest.fixture
def storm_env(broker: Broker, prefix: str, queue: str, redis_server: RedisServer) -> dict[str, str]:
    """The storm app with its locks on the test's own redis-server (broker and results shared)."""
    return storm.environment(
        broker=broker.url,
        backend=REDIS_URL,
        lock_url=redis_server.url,
        prefix=prefix,
        queue=queue,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("calls_after", [10, 0], ids=["mid-burst", "end-of-burst"])
def test_debounce_store_restarted_empty(
    calls_after: int,
    storm_app: Celery,
    worker_factory: WorkerFactory,
    redis_server: RedisServer,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """Store restarted empty during a burst: at most one extra run, the newest call runs.

    Mid-burst, the calls after the restart form the burst that runs; at the
    end of a burst, the messages from before the restart settle on the newest
    of them. Every result resolves.
    """
    worker_factory("threads", 4)
    task = storm_app.tasks["windows.debounce"]
    results = []
    for x in range(10):
        results.append(task.delay("k", x))
        time.sleep(0.05)
    redis_server.restart()
    for x in range(10, 10 + calls_after):
        results.append(task.delay("k", x))
        time.sleep(0.05)
    newest = len(results) - 1
    assert results[-1].get(timeout=30) == newest
    for x, result in enumerate(results):
        assert result.get(timeout=30) >= x
    xs = [run["x"] for run in windows.runs(db9, prefix)]
    assert xs[-1] == newest and len(xs) <= 2, xs
    if not calls_after:
        assert xs == [newest]


@pytest.mark.timeout(30)
def test_one_lua_call_per_delay(storm_app: Celery, redis_server: RedisServer) -> None:
    """Each delay() of a newest-call or period window costs the lock store one EVALSHA, no more.

    The windows that keep the first call cost what they did: one RESERVE each.
    """
    names = ("windows.debounce", "windows.latest", "windows.expired", "modes.until_executed.raise")
    tasks = [storm_app.tasks[name] for name in names]
    for task in tasks:  # warm up: connection handshake, script cache
        task.delay("warm", 0) if task.name.startswith("windows.") else task.delay("warm")
    for task in tasks:
        redis_server.reset_stats()
        for x in range(5):
            if task.name.startswith("windows."):
                task.delay("k", x)
            else:
                task.delay(x)
        stats = redis_server.commandstats()  # (commands a script runs count too)
        assert (stats.get("evalsha"), stats.get("eval")) == (5, None), (task.name, stats)
