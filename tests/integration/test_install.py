"""install(app), the worker bootstep and its start-up checks, with in-process workers."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import uuid

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redlock import ConfigurationError, SingletonTask, current_lock, install
from celery_redlock.celery import signals as redlock_signals
from celery_redlock.celery.bootsteps import RedlockStep, check_lock_store
from tests.celery_harness import wait_until
from tests.processes import dead_pid


@pytest.fixture
def app(redis_server) -> Celery:
    app = Celery(f"install-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(
        broker_url=redis_server.url,
        result_backend=redis_server.url,
        task_default_queue="plain",
        worker_hijack_root_logger=False,
    )
    return app


def test_importing_connects_nothing():
    """`import celery_redlock` adds no signal receivers and changes no Celery command."""
    code = (
        "import celery.signals as s, celery_redlock\n"
        "from celery.bin.worker import worker\n"
        "print(len(s.worker_init.receivers), "
        "any(p.name == 'redlock_queues' for p in worker.params))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "False"]


def test_installing_twice_is_harmless(app):
    """A second install adds no second bootstep or worker option."""
    install(app)
    install(app)
    assert [step for step in app.steps["worker"] if step is RedlockStep] == [RedlockStep]
    options = [o for o in app.user_options["worker"] if o.name == "redlock_queues"]
    assert len(options) <= 1


def test_singleton_task_on_a_locked_queue_takes_one_lock_with_queue_options(app):
    """Queue options apply below task attributes, and a SingletonTask is locked only once."""
    app.conf.redlock_queues = {"locked": {"ttl": 7}}
    install(app)
    seen: dict[str, float] = {}
    acquired: list[str] = []

    @app.task(base=SingletonTask, name="t.queue_ttl")
    def queue_ttl():
        seen["queue_ttl"] = current_lock().ttl

    @app.task(base=SingletonTask, name="t.own_ttl", lock_ttl=3)
    def own_ttl():
        seen["own_ttl"] = current_lock().ttl

    @app.task(name="t.plain")
    def plain():
        seen["plain"] = current_lock().ttl

    def count(sender=None, key=None, **kwargs):
        acquired.append(key)

    redlock_signals.lock_acquired.connect(count, weak=False)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, queues=["plain", "locked"]):
            for task in (queue_ttl, own_ttl, plain):
                task.apply_async(queue="locked").get(timeout=10)
    finally:
        redlock_signals.lock_acquired.disconnect(count)
    assert seen == {"queue_ttl": 7.0, "own_ttl": 3.0, "plain": 7.0}
    assert len(acquired) == 3  # one lock per run, SingletonTask included


def test_direct_calls_inside_a_locked_run_run_plainly(app):
    """A task calling itself (or another task) directly is part of the run: no lock of its own."""
    app.conf.redlock_queues = ["locked"]
    install(app)
    contended: list[str] = []

    @app.task(base=SingletonTask, name="t.total", lock_key=["n"])
    def total(n, part=None):
        if part is not None:
            return part
        # Same key as the running call: before, this met the run's own lock.
        return total(n, part=1) + total(n, part=2)

    @app.task(name="t.plain_total")
    def plain_total(n, part=None):
        if part is not None:
            return part
        return plain_total(n, part=3) + plain_total(n, part=4)

    def record(sender=None, action=None, **kwargs):
        contended.append(action)

    redlock_signals.lock_contended.connect(record, weak=False)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, queues=["plain", "locked"]):
            assert total.delay(5).get(timeout=10) == 3
            assert plain_total.apply_async((5,), queue="locked").get(timeout=10) == 7
    finally:
        redlock_signals.lock_contended.disconnect(record)
    assert contended == []


def test_an_app_wide_enqueue_mode_keeps_plain_tasks_of_a_locked_queue_locked(app, redis_server):
    """redlock_mode applies to SingletonTask; a plain task in a locked queue still locks."""
    app.conf.redlock_queues = ["locked"]
    app.conf.redlock_mode = "until_executing"
    install(app)
    started, finish = threading.Event(), threading.Event()

    @app.task(name="t.plain_slow")
    def plain_slow(x):
        started.set()
        finish.wait(10)
        return x

    with start_worker(
        app, pool="threads", concurrency=2, perform_ping_check=False, queues=["locked"]
    ):
        first = plain_slow.apply_async((1,), queue="locked")
        assert started.wait(10)
        second = plain_slow.apply_async((1,), queue="locked")
        try:
            wait_until(lambda: second.state == "SKIPPED", 5, message="the duplicate to skip")
        finally:
            finish.set()
        assert first.get(timeout=10) == 1
    assert second.state == "SKIPPED"


def test_a_plain_task_asking_for_an_enqueue_mode_stops_a_worker_locking_its_queue(app):
    """lock_mode without base=SingletonTask cannot be honoured: the worker refuses to start."""
    app.conf.redlock_queues = ["locked"]
    install(app)

    @app.task(name="t.plain_mode", lock_mode="until_executed")
    def plain_mode():
        return None

    worker = start_worker(app, pool="solo", perform_ping_check=False, queues=["locked"])
    with pytest.raises(ConfigurationError, match=r"t\.plain_mode\.lock_mode"), worker:
        pass


def test_bad_configuration_fails_a_programmatic_worker_with_the_error(app):
    """Outside the command line the bootstep raises ConfigurationError naming the setting."""
    app.conf.redlock_queues = {"plain": {"on_conflict": "drop"}}
    install(app)
    worker = start_worker(app, pool="solo", perform_ping_check=False)
    with pytest.raises(ConfigurationError, match=r"redlock_queues\['plain'\]\.on_conflict"), worker:
        pass


def test_lock_store_check_warns_when_locks_can_be_evicted(app, redis_server, caplog):
    """A lock store that may evict keys under memory pressure is reported at worker start."""
    client = redis_server.client()
    client.config_set("maxmemory", "100mb")
    client.config_set("maxmemory-policy", "volatile-lru")
    with caplog.at_level(logging.INFO):
        summary = check_lock_store(app)
    assert "answers" in summary and "volatile-lru" in summary
    assert "may evict lock keys" in caplog.text
    client.config_set("maxmemory-policy", "noeviction")
    assert "WARNING" not in check_lock_store(app)


def test_unreachable_lock_store_is_reported_not_fatal(app, redis_servers, caplog):
    """A lock store down at worker start is logged; tasks then follow on_redis_error."""
    (store,) = redis_servers(1)
    app.conf.redlock_url = store.url + "?socket_connect_timeout=0.2"
    store.stop()
    with caplog.at_level(logging.ERROR):
        summary = check_lock_store(app)
    assert "unreachable" in summary
    assert "unreachable" in caplog.text


def test_installed_worker_logs_its_locked_queues(app):
    """At start the worker names the lock store and the queues it locks."""
    app.conf.redlock_queues = ["plain"]
    install(app)
    started = threading.Event()

    @app.task(name="t.noop")
    def noop():
        started.set()

    # The in-process worker reconfigures the root logger, so listen on ours directly.
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("celery_redlock.celery.bootsteps")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False):
            noop.delay()
            assert started.wait(10)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert any("locking tasks from queue(s) plain" in line for line in lines)
    assert any("answers" in line for line in lines)


def test_a_singleton_task_app_is_connected_without_install(app, redis_server):
    """Binding a SingletonTask connects the worker side: recovery, counters, the bootstep."""
    import redis

    from celery_redlock.celery import stats
    from celery_redlock.core.holder import Holder

    app.conf.redlock_url = redis_server.url
    ran = threading.Event()

    @app.task(base=SingletonTask, name="t.connected")
    def connected():
        ran.set()

    node = f"connected-{uuid.uuid4().hex[:6]}@{Holder.new('x').host}"
    # A lock left by a dead earlier run of this very worker (same node, same host).
    base = Holder.new("dead-task", node, ttl=60)
    stale = Holder(**{**base.__dict__, "pid": dead_pid()})
    client = redis.Redis.from_url(redis_server.url)
    client.set(connected.lock_key_for(), stale.encode(), px=60_000)
    with start_worker(app, pool="solo", perform_ping_check=False, hostname=node):
        assert RedlockStep in app.steps["worker"]
        assert not client.exists(connected.lock_key_for())  # recovered at start
        assert stats.table_for(app) is not None  # redlock_stats is on by default
        connected.delay()
        assert ran.wait(10)
