"""Hand-over of per-queue locking to pool processes started with spawn (main-process side)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from celery import Celery
from celery.concurrency.prefork import TaskPool
from celery.concurrency.solo import TaskPool as SoloPool
from kombu import Exchange, Queue

from celery_redlock.celery import spawned
from celery_redlock.celery.stats import disable, disabled_because, enable, table_for


@pytest.mark.parametrize(
    ("pool_cls", "start_method", "expected"),
    [(TaskPool, "spawn", True), (TaskPool, "fork", False), (SoloPool, "spawn", False)],
)
def test_only_a_prefork_pool_set_to_spawn_spawns(pool_cls, start_method, expected):
    """The hand-over is for prefork pools that spawn; solo and forking pools need none."""
    worker = SimpleNamespace(pool_cls=pool_cls, pool_start_method=start_method)
    assert spawned.spawns_pool_processes(worker) is expected


def test_hand_over_passes_routes_and_option_and_names_the_hook(monkeypatch):
    """The environment carries the consumed routes and --redlock-queues; imports gets the hook."""
    monkeypatch.setenv(spawned.ENV_VAR, "")  # restored (removed) at teardown
    app = Celery("handover", set_as_current=False)
    app.conf.imports = ("proj.tasks",)
    consumed = {"a": Queue("a", Exchange("ex", type="direct"), routing_key="rk")}
    spawned.hand_over(app, "a", consumed)
    spawned.hand_over(app, "a", consumed)  # a worker restarted in the same process
    setup = json.loads(os.environ[spawned.ENV_VAR])
    assert setup == {"app": "handover", "cli": "a", "queues": [["a", "ex", "direct", "rk"]]}
    assert app.conf.imports == ("proj.tasks", spawned.HOOK_MODULE)


def test_disabled_counters_say_why_until_enabled_again():
    """A worker whose counters are off reports the reason; enabling them clears it."""
    app = Celery("counting", set_as_current=False)
    disable(app, "spawned")
    assert table_for(app) is None and disabled_because(app) == "spawned"
    assert enable(app, processes=1) is table_for(app)
    assert disabled_because(app) is None
