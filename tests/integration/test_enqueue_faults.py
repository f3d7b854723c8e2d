"""Enqueue locks when something goes wrong: lost replies, Redis errors at task start, lapses.

Each test runs on a private redis-server (the lock store) with an in-memory
broker and result backend, and, where a worker is needed, an in-process
``celery.contrib.testing`` worker. Redis failures are real: a loopback proxy
that holds commands back makes the client time out while they still run
later; an ACL that refuses ``EVAL``/``EVALSHA`` makes every lock script fail
while plain commands still work.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery
from celery import signals as celery_signals
from celery.contrib.testing.worker import start_worker
from kombu.transport import memory

from celery_redlock import (
    ConfigurationError,
    LockError,
    LockNotAcquired,
    SingletonTask,
    current_lock,
)
from celery_redlock.celery import signals as redlock_signals
from celery_redlock.celery.bootsteps import prepare_worker
from celery_redlock.celery.messages import REQUEUES_HEADER, RESERVATION_HEADER
from celery_redlock.celery.publish import cancel_key
from celery_redlock.celery.window import reservation_key
from celery_redlock.core.window_scripts import CANCEL_RESERVE, RESERVE
from tests.fault_proxy import DelayProxy


@pytest.fixture(autouse=True)
def _signal_receivers_end_with_the_test() -> Iterator[None]:
    """Disconnect, after each test, the receivers it connected (they append, assert, or
    change the server's ACL, and must not run during later tests)."""
    watched = [
        celery_signals.before_task_publish,
        *(getattr(redlock_signals, name) for name in redlock_signals.__all__),
    ]
    before = [list(signal.receivers) for signal in watched]
    yield
    for signal, receivers in zip(watched, before):
        signal.receivers[:] = receivers
        signal.sender_receivers_cache.clear()


class Overlap:
    """Counts the bodies of one task running at once; ``peak`` is the most seen."""

    def __init__(self) -> None:
        self.active = self.peak = 0
        self._mutex = threading.Lock()

    @contextmanager
    def running(self) -> Iterator[None]:
        with self._mutex:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            yield
        finally:
            with self._mutex:
                self.active -= 1


class PromptMemoryTransport(memory.Transport):
    """The in-memory broker, whose idle polls of the worker's loop last 0.1 s, not 2 s.

    The worker's blocking loop (``synloop``, the loop of a broker without an
    event loop) drains with a 2 s timeout and, once told to stop, drains once
    more before it stops: up to 4 s of every in-process worker's exit, spent
    polling an empty queue. A message still arrives the moment it is sent.
    """

    def drain_events(self, connection: Any, timeout: float | None = None) -> Any:
        return super().drain_events(connection, None if timeout is None else min(timeout, 0.1))


@pytest.fixture
def make_app(redis_server: Any) -> Any:
    def make(url_query: str = "", **conf: Any) -> Celery:
        app = Celery(f"faults-{uuid.uuid4().hex[:8]}", set_as_current=False)
        app.conf.update(
            broker_url="memory://",
            broker_transport=PromptMemoryTransport,
            result_backend="cache+memory://",
            # The in-memory broker polls; a short interval delivers promptly.
            broker_transport_options={"polling_interval": 0.02},
            redlock_url=redis_server.url + url_query,
            redlock_key_prefix=f"faults-{uuid.uuid4().hex[:8]}",
            **conf,
        )
        return app

    return make


@contextmanager
def worker(app: Celery, pool: str = "threads", concurrency: int = 2) -> Iterator[Any]:
    with start_worker(
        app, pool=pool, concurrency=concurrency, perform_ping_check=False, shutdown_timeout=10
    ) as running:
        yield running


def scripts_allowed(r: redis.Redis, allowed: bool) -> None:
    """Let the lock store run Lua scripts, or refuse them (the lock scripts then fail)."""
    r.execute_command("ACL", "SETUSER", "default", "+eval" if allowed else "-eval")
    r.execute_command("ACL", "SETUSER", "default", "+evalsha" if allowed else "-evalsha")


def published_ids(app: Celery) -> list[str]:
    """Collect the id of every message ``app`` publishes from now on."""
    ids: list[str] = []

    def record(sender: Any = None, headers: Any = None, **_: Any) -> None:
        ids.append(headers["id"])

    celery_signals.before_task_publish.connect(record, weak=False)
    return ids


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# -- H1: a RESERVE whose reply is lost ---------------------------------------------


def test_cancel_reserve_voids_a_late_reserve_and_undoes_an_early_one(r: redis.Redis) -> None:
    """CANCEL_RESERVE works whichever side of the lost RESERVE it runs on."""
    key, void = "{t}:k", cancel_key("{t}:k")
    # Cancel first: the RESERVE that arrives late stores nothing.
    assert CANCEL_RESERVE.send(r, (key, void), ("V1", "", 1, 5000)) == 0
    assert RESERVE(r, (key, void), ("V1", 5000, "")) == 0
    assert not r.exists(key)
    assert RESERVE(r, (key, void), ("V2", 5000, "")) == 1  # another value is not voided
    # Cancel after: the stored reservation goes; another holder's stays.
    assert CANCEL_RESERVE.send(r, (key, void), ("V2", "", 1, 5000)) == 1
    assert not r.exists(key)
    r.set(key, "other", px=5000)
    assert CANCEL_RESERVE.send(r, (key, void), ("V3", "", 1, 5000)) == 0
    assert r.get(key) == b"other"
    # A lent execution lock is put back in place of the retry's reservation.
    r.set(key, "V4", px=5000)
    assert CANCEL_RESERVE.send(r, (key, void), ("V4", "TOKEN", 3000, 5000)) == 1
    assert r.get(key) == b"TOKEN" and 0 < r.pttl(key) <= 3000


def test_lost_reserve_reply_leaves_no_phantom_reservation(
    make_app: Any, redis_server: Any, r: redis.Redis
) -> None:
    """A RESERVE that times out but runs later folds no later call into an unpublished task."""
    app = make_app(redlock_on_redis_error="raise")
    proxy = DelayProxy(redis_server.port)
    app.conf.redlock_url = proxy.url + "?socket_timeout=0.3"

    @app.task(base=SingletonTask, shared=False, name="t.phantom", lock_mode="until_executed")
    def job(x: int) -> int:
        return x

    with proxy:
        job.delay(0)  # connects and caches RESERVE
        ids = published_ids(app)
        redis_server.reset_stats()
        # What the lock store is sent from now on reaches it 0.8 s late: the
        # RESERVE's reply cannot come within the client's 0.3 s, and the
        # RESERVE itself runs after the client gave up on it.
        proxy.hold(time.monotonic() + 0.8)
        with pytest.raises(LockError) as info:
            job.delay(1)
        proxy.stop_holding()
        assert "was not published" in str(info.value) and ids == []
        # Since the reset, the RESERVE is the only EVALSHA and each cancel an
        # EVAL: once both ran, in whichever order, the outcome is final.
        wait_for(lambda: {"eval", "evalsha"} <= redis_server.commandstats().keys(), timeout=10)
        assert not r.exists(job.lock_key_for(1))
        again = job.delay(1)
        assert ids == [again.id]


# -- H2: Redis fails when the worker starts the task --------------------------------

ENQUEUE_MODES = ("until_executing", "until_executed", "until_and_while_executing")


@pytest.mark.parametrize("mode", ENQUEUE_MODES)
def test_reservation_does_not_outlive_a_run_without_the_lock(
    make_app: Any, r: redis.Redis, mode: str
) -> None:
    """on_redis_error="run": the body runs, and its reservation goes once Redis is back."""
    app = make_app()
    ran: list[str] = []

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.stale",
        lock_mode=mode,
        lock_on_redis_error="run",
    )
    def job(self: Any, x: int) -> int:
        ran.append(self.request.id)
        scripts_allowed(r, True)  # the outage ends while the task runs
        return x

    first = job.delay(1)
    rkey = reservation_key(mode, job.lock_key_for(1))
    assert r.exists(rkey)
    scripts_allowed(r, False)
    try:
        with worker(app):
            assert first.get(timeout=10) == 1
            assert not r.exists(rkey)
            second = job.delay(1)
            assert second.id != first.id
            assert second.get(timeout=10) == 1
    finally:
        scripts_allowed(r, True)
    assert ran == [first.id, second.id]


def test_requeue_while_redis_is_down_keeps_the_reservation(make_app: Any, r: redis.Redis) -> None:
    """on_redis_error="requeue": the requeued copy carries its reservation and takes it over."""
    app = make_app()
    lapsed: list[Any] = []
    redlock_signals.lock_lapsed.connect(lambda **kw: lapsed.append(kw), weak=False)

    @app.task(
        base=SingletonTask,
        shared=False,
        name="t.requeue",
        lock_mode="until_executed",
        lock_requeue_delay=0.05,
        lock_requeue_jitter=0,
    )
    def job(x: int) -> int:
        return x

    def end_outage(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if headers.get(REQUEUES_HEADER):
            assert headers.get(RESERVATION_HEADER)  # the message keeps its reservation
            scripts_allowed(r, True)

    celery_signals.before_task_publish.connect(end_outage, weak=False)
    try:
        first = job.delay(1)
        scripts_allowed(r, False)
        with worker(app):
            assert first.get(timeout=15) == 1
    finally:
        celery_signals.before_task_publish.disconnect(end_outage)
        scripts_allowed(r, True)
    assert not r.exists(job.lock_key_for(1))
    assert lapsed == []


# -- H3: locked-queue options that would change the key ---------------------------


@pytest.mark.parametrize("option", ["key_prefix", "key", "enqueue_ttl", "on_duplicate"])
def test_publish_side_queue_options_refused_at_worker_start(make_app: Any, option: str) -> None:
    """A locked queue cannot change what apply_async reserves: the worker refuses to start."""
    value = {"key_prefix": "other", "key": ["x"], "enqueue_ttl": 5, "on_duplicate": "raise"}
    app = make_app(task_default_queue="locked", redlock_queues={"locked": {option: value[option]}})

    @app.task(base=SingletonTask, shared=False, name="t.queued", lock_mode="until_executed")
    def job(x: int) -> int:
        return x

    app.finalize()
    with pytest.raises(ConfigurationError) as info:
        prepare_worker(app, None, dict(app.amqp.queues))
    assert info.value.setting == f"redlock_queues['locked'].{option}"
    assert "t.queued" in str(info.value)


def test_worker_side_queue_options_still_apply_to_enqueue_modes(make_app: Any) -> None:
    """Options read only by the worker (on_conflict, ttl) are allowed in a queue entry and apply."""
    app = make_app(
        task_default_queue="locked",
        redlock_queues={"locked": {"on_conflict": "raise", "ttl": 5}},
    )
    started, finish = threading.Event(), threading.Event()
    ttls: list[float] = []

    @app.task(base=SingletonTask, shared=False, name="t.queued", lock_mode="until_executed")
    def job(x: int) -> int:
        ttls.append(current_lock().ttl)
        started.set()
        finish.wait(10)
        return x

    app.finalize()
    prepare_worker(app, None, dict(app.amqp.queues))
    with worker(app):
        first = job.delay(1)
        assert started.wait(10)
        # A message that bypassed apply_async carries no reservation and meets
        # the lock as a duplicate: the queue's on_conflict="raise" fails it
        # (the task's default, "skip", would leave it SKIPPED).
        duplicate = app.send_task("t.queued", (1,))
        with pytest.raises(LockNotAcquired) as info:
            duplicate.get(timeout=10)
        assert first.id in str(info.value)
        finish.set()
        assert first.get(timeout=10) == 1
    assert ttls == [5]  # the queue's ttl, not the default 10 s


# -- M1: the waiting copy of until_and_while_executing ------------------------------


def test_until_and_while_executing_runs_the_waiting_copy_by_default(
    make_app: Any, r: redis.Redis
) -> None:
    """A copy that reaches a worker while the first runs is run after it, not skipped."""
    app = make_app()
    ran: list[str] = []
    started, met = threading.Event(), threading.Event()
    actions: list[str] = []

    def contended(action: str = "", **_: Any) -> None:
        actions.append(action)
        met.set()

    redlock_signals.lock_contended.connect(contended, weak=False)

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.uaw",
        lock_mode="until_and_while_executing",
        lock_requeue_delay=0.1,
        lock_requeue_max_delay=0.2,
    )
    def job(self: Any, x: int) -> int:
        ran.append(self.request.id)
        started.set()
        met.wait(10)  # the first run lasts until the waiting copy has met its lock
        return x

    try:
        with worker(app, concurrency=2):
            first = job.delay(1)
            assert started.wait(10)
            waiting = [job.delay(1) for _ in range(5)]
            assert len({result.id for result in waiting}) == 1
            assert waiting[0].get(timeout=10) == 1
            assert first.get(timeout=5) == 1
    finally:
        redlock_signals.lock_contended.disconnect(contended)
    assert actions[0] == "requeue"
    assert ran == [first.id, waiting[0].id]


# -- M3: a lapsed reservation never drops the call ----------------------------------


@pytest.mark.parametrize("mode", ENQUEUE_MODES)
def test_a_lapsed_copy_meeting_a_newer_reservation_still_runs(
    make_app: Any, r: redis.Redis, mode: str
) -> None:
    """The copy whose reservation lapsed runs (and says so) although a newer copy is reserved."""
    app = make_app()
    ran: list[str] = []
    lapsed: list[Any] = []
    redlock_signals.lock_lapsed.connect(lambda **kw: lapsed.append(kw["task_id"]), weak=False)

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.lapse",
        lock_mode=mode,
        lock_enqueue_ttl=0.2,
        lock_requeue_delay=0.1,
        lock_requeue_max_delay=0.2,
    )
    def job(self: Any, x: int) -> int:
        ran.append(self.request.id)
        return x

    old = job.delay(1)
    rkey = reservation_key(mode, job.lock_key_for(1))
    wait_for(lambda: not r.exists(rkey))
    new = job.apply_async((1,), countdown=1)
    assert new.id != old.id
    with worker(app, pool="solo", concurrency=1):
        assert old.get(timeout=15) == 1
        assert new.get(timeout=15) == 1
    assert sorted(ran) == sorted([old.id, new.id])
    assert old.id in lapsed


# -- M2: code after self.retry() in until_executed ----------------------------------


def test_cleanup_after_retry_never_overlaps_the_next_attempt(make_app: Any, r: redis.Redis) -> None:
    """The lock passes to the retry when the attempt ends, not when the retry is published."""
    app = make_app()
    overlap, finished = Overlap(), []
    lapsed: list[Any] = []
    redlock_signals.lock_lapsed.connect(lambda **kw: lapsed.append(kw), weak=False)

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.retry_cleanup",
        lock_mode="until_executed",
        lock_requeue_delay=0.05,
        lock_requeue_max_delay=0.1,
        max_retries=1,
    )
    def job(self: Any, x: int) -> int:
        try:
            with overlap.running():
                if self.request.retries == 0:
                    try:
                        raise self.retry(countdown=0)
                    finally:
                        time.sleep(0.5)  # the attempt's own cleanup, after the retry is out
                return x
        finally:
            finished.append(self.request.retries)

    with worker(app, concurrency=2):
        result = job.delay(1)
        assert result.get(timeout=15) == 1
    assert finished == [0, 1]
    assert overlap.peak == 1
    assert not r.exists(job.lock_key_for(1))
    assert lapsed == []


def test_a_retry_published_with_throw_false_runs_after_the_attempt(
    make_app: Any, r: redis.Redis
) -> None:
    """retry(throw=False), then success: the retry waits for the attempt, then still runs."""
    app = make_app()
    overlap, finished = Overlap(), []

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.retry_no_throw",
        lock_mode="until_executed",
        lock_requeue_delay=0.05,
        lock_requeue_max_delay=0.1,
        max_retries=1,
    )
    def job(self: Any, x: int) -> int:
        try:
            with overlap.running():
                if self.request.retries == 0:
                    self.retry(countdown=0, throw=False)  # a follow-up, then this attempt goes on
                    time.sleep(0.5)
                return x
        finally:
            finished.append(self.request.retries)

    with worker(app, concurrency=2):
        job.delay(1)
        wait_for(lambda: len(finished) == 2, timeout=15)
    assert finished == [0, 1]
    assert overlap.peak == 1
    wait_for(lambda: not r.exists(job.lock_key_for(1)), timeout=5)
