"""The operator commands on a Redlock lock store: every master is read and cleaned."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_redlock.core.holder import Holder
from celery_redlock.core.keys import KeyBuilder
from celery_redlock.core.store import store_for
from celery_redlock.ops.cli import redlock
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def servers(redis_servers: Any) -> list[RedisServer]:
    """Three private masters."""
    started: list[RedisServer] = redis_servers(3)
    return started


@pytest.fixture
def app(servers: list[RedisServer]) -> Iterator[Celery]:
    """An app whose lock store is the three masters (Redlock)."""
    app = Celery("ops-redlock", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        redlock_url=[server.url for server in servers],
        redlock_key_prefix="opsr",
    )
    try:
        yield app
    finally:
        app.close()


def invoke(app: Celery, *args: str) -> Result:
    """Run ``celery redlock <args>`` in this process against ``app``."""
    return CliRunner().invoke(
        redlock, list(args), obj=CLIContext(app=app, no_color=True, workdir=None)
    )


def test_list_shows_a_redlock_lock_once_and_purge_clears_every_master(
    app: Celery, servers: list[RedisServer]
) -> None:
    """A lock held on all three masters is listed once; purge deletes it from each."""
    key = KeyBuilder("app.r", lambda n: n, None, "opsr").key_for((1,), {})
    holder = Holder.new("task-r", "w1@h", ttl=30)
    lock = store_for(app).lock(key, timeout=30, blocking=False, auto_renew=False)
    assert lock.acquire(token=holder.encode())
    clients = [server.client() for server in servers]
    assert sum(bool(client.exists(key)) for client in clients) >= 2

    listed = json.loads(invoke(app, "list", "--json").output)
    assert [entry["key"] for entry in listed] == [key]
    assert listed[0]["holder"]["task_id"] == "task-r"

    done = invoke(app, "purge", "--all", "--yes")
    assert done.exit_code == 0, done.output
    assert "deleted 1 lock(s)" in done.output
    assert not any(client.exists(key) for client in clients)
