"""The publish side of the newest-call windows: what ``apply_async`` refuses before any stamp.

Messages go to an in-memory broker, the lock store is a private redis-server,
so no worker is needed to see what was (not) stamped.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from celery import Celery, chord, group

from celery_redlock import ConfigurationError, SingletonTask

WINDOWS = [
    {"lock_mode": "debounce", "lock_debounce": 1},
    {"lock_mode": "until_and_while_executing", "lock_keep": "latest"},
]


@pytest.fixture
def app(redis_server: Any) -> Celery:
    app = Celery(f"newest-{uuid.uuid4().hex[:8]}", set_as_current=False)
    backend = redis_server.url.removesuffix("/0") + "/1"  # chords need one; db 0 is the store's
    app.conf.update(broker_url="memory://", result_backend=backend, redlock_url=redis_server.url)
    return app


def _task(app: Celery, options: dict[str, Any]) -> Any:
    @app.task(base=SingletonTask, shared=False, name="t.newest", lock_key=["k"], **options)
    def newest(k: Any, x: Any) -> Any:
        return x

    @app.task(shared=False, name="t.total")
    def total(xs: Any) -> Any:
        return sum(xs)

    return newest


@pytest.mark.parametrize("options", WINDOWS)
def test_a_group_or_chord_member_is_refused_before_anything_is_stamped(
    app: Celery, r: redis.Redis, options: dict[str, Any]
) -> None:
    """A superseded member would leave its group's result and its chord waiting for ever."""
    task = _task(app, options)
    with pytest.raises(ConfigurationError) as grouped:
        group(task.s("k", x) for x in range(3)).apply_async()
    assert grouped.value.setting == "group_id"
    with pytest.raises(ConfigurationError) as chorded:
        chord([task.s("k", x) for x in range(3)], app.tasks["t.total"].s()).apply_async()
    assert chorded.value.setting in ("chord", "group_id")
    assert r.keys("*") == []
    task.apply_async(("k", 1), link=app.tasks["t.total"].s())  # a link alone is fine
    assert r.keys("*newest")
