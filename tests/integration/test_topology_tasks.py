"""SingletonTask, unchanged, on a Redlock store (a list of URLs) and on a Sentinel store.

Also: an unreachable Cluster and a bad Redlock list, as a worker meets them.

The Cluster store has its own module (``test_topology_cluster.py``), which
shares one cluster between its tests.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redlock import (
    SKIPPED,
    ConfigurationError,
    LockError,
    SingletonTask,
    current_lock,
    install,
)
from celery_redlock.celery.bootsteps import check_lock_store
from celery_redlock.core.holder import Holder
from celery_redlock.core.store import store_for
from tests.redis_topologies import MASTER_NAME, LocalSentinel

pytestmark = pytest.mark.slow


@contextmanager
def store_settings(kind: str, redis_servers, redis_server_binary, tmp_path) -> Iterator[dict]:
    """``redlock_*`` settings of a fresh store of ``kind``, and a way to read its masters."""
    if kind == "redlock":
        masters = redis_servers(3)
        yield {
            "settings": {"redlock_url": [server.url for server in masters]},
            "masters": [server.client() for server in masters],
        }
        return
    with LocalSentinel(redis_server_binary, tmp_path / "sentinel") as group:
        yield {
            "settings": {
                "redlock_url": group.url,
                "redlock_transport_options": {"master_name": MASTER_NAME},
            },
            "masters": [group.master.client()],
        }


@pytest.mark.parametrize("kind", ["redlock", "sentinel"])
def test_singleton_task_runs_unchanged_on_the_store(
    kind, redis_server, redis_servers, redis_server_binary, tmp_path
):
    """The duplicate is SKIPPED naming the holder, fences rise, and no lock is left behind."""
    prefix = f"t{kind[:2]}{uuid.uuid4().hex[:6]}"
    with store_settings(kind, redis_servers, redis_server_binary, tmp_path) as store:
        app = Celery(f"topology-{prefix}", set_as_current=False)
        app.conf.update(
            broker_url=redis_server.url,
            result_backend=redis_server.url,
            task_default_queue=f"q-{prefix}",
            worker_hijack_root_logger=False,
            broker_connection_retry_on_startup=False,
            redlock_key_prefix=prefix,
            redlock_ttl=3,
            **store["settings"],
        )
        assert "answers" in check_lock_store(app)
        started, finish = threading.Event(), threading.Event()

        @app.task(base=SingletonTask, name=f"t.sync_on_{kind}")
        def sync(account):
            started.set()
            finish.wait(10)
            return current_lock().fence

        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
            first = sync.delay("acme")
            assert started.wait(10)
            key = sync.lock_key_for("acme")
            # Held on a majority of the masters (all of them, once connections are open).
            held = sum(master.exists(key) for master in store["masters"])
            assert held > len(store["masters"]) // 2
            second = sync.delay("acme")
            deadline = time.monotonic() + 10
            while second.state != SKIPPED and time.monotonic() < deadline:
                time.sleep(0.05)
            assert second.state == SKIPPED and second.info["holder"] == first.id
            finish.set()
            fence = first.get(timeout=10)
            assert sync.delay("acme").get(timeout=10) > fence
        for master in store["masters"]:
            assert master.exists(key) == 0
        store_for(app).close()


def test_killed_holder_is_released_on_every_redlock_master(redis_servers):
    """The SIGKILL hook's release reaches each master, and only the dead holder's lock."""
    masters = redis_servers(3)
    app = Celery(f"topology-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.redlock_url = [server.url for server in masters]
    store = store_for(app)
    dead = Holder.new("dead-task", "host-a")
    lock = store.lock("t:v1:{t.job:1}", timeout=30)
    assert lock.acquire(blocking=False, token=dead.encode())
    other = store.lock("t:v1:{t.job:2}", timeout=30)
    assert other.acquire(blocking=False, token=Holder.new("live", "host-b").encode())

    def holding(name: str) -> int:
        return sum(server.client().exists(name) for server in masters)

    held, held_by_other = holding("t:v1:{t.job:1}"), holding("t:v1:{t.job:2}")
    # A majority each; a master connected late may miss a first acquisition.
    assert held >= 2 and held_by_other >= 2
    assert store.release_held_by("t:v1:{t.job:2}", Holder.fragment("dead-task", "host-a")) == 0
    assert store.release_held_by("t:v1:{t.job:1}", Holder.fragment("dead-task", "host-a")) == held
    assert holding("t:v1:{t.job:1}") == 0
    assert holding("t:v1:{t.job:2}") == held_by_other
    store.close()


def test_unreachable_cluster_follows_on_redis_error(redis_server):
    """A Cluster that cannot be reached when the client is built is a Redis error, not a crash.

    redis-py connects while building a Cluster client; the task's
    on_redis_error policy decides (here: raise LockError), as for any outage.
    """
    app = Celery(f"topology-{uuid.uuid4().hex[:8]}", set_as_current=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]  # nobody listens once the block ends
    app.conf.update(
        broker_url=redis_server.url,
        redlock_url=f"redis+cluster://127.0.0.1:{closed_port}?socket_connect_timeout=0.2",
        redlock_on_redis_error="raise",
    )
    runs = []

    @app.task(base=SingletonTask, name="t.cluster_down")
    def job():
        runs.append(1)

    with pytest.raises(LockError, match="lock store unreachable"):
        job.apply(throw=True).get()
    assert runs == []
    assert "unreachable" in check_lock_store(app)


def test_a_list_naming_one_server_twice_stops_the_worker(redis_server):
    """A Redlock list with a duplicate master fails at worker start, naming the entry."""
    app = Celery(f"topology-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(
        broker_url=redis_server.url,
        worker_hijack_root_logger=False,
        redlock_url=[redis_server.url, "redis://127.0.0.1:1/0", redis_server.url],
    )
    install(app)
    worker = start_worker(app, pool="solo", perform_ping_check=False)
    duplicate = r"redlock_url\[2\].*same server"
    with pytest.raises(ConfigurationError, match=duplicate) as info, worker:
        pass
    assert info.value.setting == "redlock_url[2]"
