"""SingletonTask through every outcome of a task's life, with an in-process worker.

Each test builds a Celery app on a private redis-server (broker, results and
locks), declares its tasks, and runs them on ``celery.contrib.testing``'s
in-process worker. Outcomes that need a separate process to die or time out
live in ``tests/integration/celery/``.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from typing import ClassVar

import pytest
from celery import Celery, chain, chord
from celery import signals as celery_signals
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Ignore, Reject

from celery_redlock import (
    SKIPPED,
    DuplicateSkipped,
    LockError,
    LockNotAcquired,
    SingletonTask,
    current_lock,
)
from celery_redlock.celery import signals as redlock_signals
from celery_redlock.celery.messages import requeues_of


@pytest.fixture
def make_app(redis_server):
    """Build a fresh app whose broker, backend and lock store are the private server."""

    def make(**conf) -> Celery:
        app = Celery(f"lifecycle-{uuid.uuid4().hex[:8]}", set_as_current=False)
        settings = {
            "broker_url": redis_server.url,
            "result_backend": redis_server.url,
            "task_default_queue": f"q-{uuid.uuid4().hex[:8]}",
            "worker_hijack_root_logger": False,
            "broker_connection_retry_on_startup": False,
            # Longer than any test here runs: a lock key that is gone was
            # released, it cannot have expired.
            "redlock_ttl": 60,
        }
        app.conf.update({**settings, **conf})
        return app

    return make


@contextmanager
def worker(app: Celery, pool: str = "threads", concurrency: int = 4):
    with start_worker(
        app, pool=pool, concurrency=concurrency, perform_ping_check=False, shutdown_timeout=10
    ) as running:
        yield running


@contextmanager
def received(*signals):
    """Collect every send of ``signals`` while the block runs, each with its ``sent_by`` name."""
    events: list[dict] = []
    receivers = []
    for signal in signals:

        def receive(sender=None, _name=signal.name, **kwargs):
            events.append({**kwargs, "sent_by": _name, "at": time.monotonic()})

        signal.connect(receive, weak=False)
        receivers.append((signal, receive))
    try:
        yield events
    finally:
        for signal, receive in receivers:
            signal.disconnect(receive)


def wait_for(events: list[dict], count: int, timeout: float = 10, **match) -> None:
    """Wait until ``count`` collected events have all the ``match`` items."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(all(e.get(k) == v for k, v in match.items()) for e in events) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"fewer than {count} of {len(events)} events match {match}")


def lock_keys(redis_server) -> list[bytes]:
    client = redis_server.client()
    return [k for k in client.scan_iter("redlock:v1:*") if not k.endswith(b":fence")]


def test_success_releases_before_the_result_is_visible(make_app, redis_server, monkeypatch):
    """The lock is gone when SUCCESS is stored: a caller seeing the result can run it again."""
    app = make_app()
    runs: list[int] = []
    client = redis_server.client()
    held_when_stored: list[int] = []

    @app.task(base=SingletonTask, name="t.quick")
    def quick(x):
        runs.append(x)
        return current_lock().fence

    key = quick.lock_key_for(1)
    # Look at the lock key from inside the result store, at the moment the
    # result becomes visible: no race with the caller decides the outcome.
    # (On the class: each worker thread has a backend instance of its own.)
    backend_class = type(app.backend)
    store_result = backend_class.store_result

    def store_and_look(self, task_id, result, state, *args, **kwargs):
        if state == "SUCCESS":
            held_when_stored.append(client.exists(key))
        return store_result(self, task_id, result, state, *args, **kwargs)

    monkeypatch.setattr(backend_class, "store_result", store_and_look)
    with worker(app):
        fences = [quick.delay(1).get(timeout=10) for _ in range(10)]
    assert held_when_stored == [0] * 10
    assert runs == [1] * 10
    assert fences == sorted(set(fences))
    assert lock_keys(redis_server) == []


@pytest.mark.parametrize("outcome", ["SUCCESS", "FAILURE"])
@pytest.mark.parametrize("mode", ["while_executing", "until_executed", "until_and_while_executing"])
def test_every_locked_mode_releases_before_any_outcome_is_stored(
    make_app, redis_server, monkeypatch, mode, outcome
):
    """In every mode that locks the run, its keys are gone when SUCCESS or FAILURE is stored.

    A caller that sees either outcome may publish the same call at once: it must
    neither meet the finished run's lock nor be folded into its reservation.
    """
    app = make_app()
    held: list[bool] = []
    seen_when_stored: list[tuple[str, list[bytes]]] = []

    @app.task(base=SingletonTask, name=f"t.ends.{mode}", lock_mode=mode)
    def ends(x):
        held.append(current_lock() is not None)
        if outcome == "FAILURE":
            raise ValueError(x)
        return x

    # As above: look at the keys from inside the result store, when the outcome
    # becomes visible (on the class: each worker thread has its own backend).
    backend_class = type(app.backend)
    store_result = backend_class.store_result

    def store_and_look(self, task_id, result, state, *args, **kwargs):
        if state in ("SUCCESS", "FAILURE"):
            seen_when_stored.append((state, lock_keys(redis_server)))
        return store_result(self, task_id, result, state, *args, **kwargs)

    monkeypatch.setattr(backend_class, "store_result", store_and_look)
    with worker(app):
        for x in range(3):
            result = ends.delay(x)
            result.get(timeout=10, propagate=False)
            assert result.state == outcome
    assert held == [True] * 3
    assert seen_when_stored == [(outcome, [])] * 3
    assert lock_keys(redis_server) == []


def test_failure_releases(make_app, redis_server):
    """A task that raises releases its lock and fails normally."""
    app = make_app()

    @app.task(base=SingletonTask, name="t.boom")
    def boom():
        raise ValueError("boom")

    with worker(app):
        result = boom.delay()
        with pytest.raises(ValueError):
            result.get(timeout=10)
    assert lock_keys(redis_server) == []


def test_retry_is_not_blocked_by_its_own_lock(make_app, redis_server):
    """self.retry() republishes the same id; the retry runs instead of meeting its own lock."""
    app = make_app()
    attempts: list[int] = []

    @app.task(base=SingletonTask, bind=True, name="t.flaky", max_retries=3)
    def flaky(self, x):
        attempts.append(self.request.retries)
        if self.request.retries < 2:
            raise self.retry(countdown=0)
        return "done"

    with worker(app):
        assert flaky.delay(1).get(timeout=30) == "done"
    assert attempts == [0, 1, 2]
    assert lock_keys(redis_server) == []


def test_autoretry_runs_every_attempt_and_releases(make_app, redis_server):
    """autoretry_for retries run under the lock, one after another, and end released."""
    app = make_app()
    attempts: list[int] = []

    @app.task(
        base=SingletonTask,
        bind=True,
        name="t.auto",
        autoretry_for=(KeyError,),
        retry_backoff=False,
        default_retry_delay=0,
        max_retries=2,
    )
    def auto(self):
        attempts.append(self.request.retries)
        raise KeyError("again")

    with worker(app), pytest.raises(KeyError):
        auto.delay().get(timeout=30)
    assert attempts == [0, 1, 2]
    assert lock_keys(redis_server) == []


@pytest.mark.parametrize("outcome", ["reject", "ignore"])
def test_reject_and_ignore_release(make_app, redis_server, outcome):
    """Reject and Ignore end the run without a result, and the lock is released (not expired)."""
    app = make_app()

    @app.task(base=SingletonTask, name=f"t.{outcome}")
    def ends():
        raise Reject("no", requeue=False) if outcome == "reject" else Ignore()

    with worker(app), received(redlock_signals.lock_released) as events:
        result = ends.delay()
        wait_for(events, 1, task_id=result.id)
        # The TTL (60 s) is far away: only a release can have removed the key.
        assert lock_keys(redis_server) == []
    (released,) = events
    assert released["owned"] is True
    assert released["key"] == ends.lock_key_for()


def test_skip_records_a_distinct_state_naming_the_holder(make_app, redis_server):
    """A duplicate under skip ends SKIPPED with the holder's id, never as SUCCESS."""
    app = make_app()
    started, finish = threading.Event(), threading.Event()

    @app.task(base=SingletonTask, name="t.hold")
    def hold(x):
        started.set()
        finish.wait(10)
        return x

    with worker(app):
        first = hold.delay(7)
        assert started.wait(10)
        second = hold.delay(7)
        deadline = time.monotonic() + 10
        while second.state != SKIPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert second.state == SKIPPED
        assert second.info["holder"] == first.id
        assert second.info["key"] == hold.lock_key_for(7)
        other = hold.delay(8)  # another signature is not a duplicate
        finish.set()
        assert first.get(timeout=10) == 7
        assert other.get(timeout=10) == 8


def test_get_of_a_skipped_duplicate_raises_at_once_naming_the_holder(make_app):
    """.get() on a SKIPPED call raises DuplicateSkipped instead of waiting out its timeout."""
    app = make_app()
    started, finish = threading.Event(), threading.Event()

    @app.task(base=SingletonTask, name="t.hold_for_get")
    def hold(x):
        started.set()
        finish.wait(20)
        return x

    with worker(app):
        first = hold.delay(1)
        assert started.wait(10)
        second = hold.delay(1)
        # The timeout is far beyond the test's own bound: only a prompt answer passes.
        with pytest.raises(DuplicateSkipped) as skipped:
            second.get(timeout=600)
        assert second.state == SKIPPED  # still visible as such to Flower and .state
        assert skipped.value.holder == first.id
        assert skipped.value.task_id == second.id
        assert skipped.value.lock_name == hold.lock_key_for(1)
        assert first.id in str(skipped.value)
        returned = second.get(timeout=600, propagate=False)
        assert isinstance(returned, DuplicateSkipped)
        finish.set()
        assert first.get(timeout=10) == 1


def _skipped_while_held(app, hold, duplicates):
    """Run ``hold(7)``, send each of ``duplicates`` while it holds, return (first, postrun states).

    ``duplicates`` are callables sending a copy of ``hold(7)`` and returning its
    id. Returns once every copy's run has ended (its ``task_postrun`` sent),
    with each copy's postrun ``state`` and ``retval`` by id.
    """
    ended: dict[str, tuple] = {}

    def postrun(task_id=None, state=None, retval=None, **kwargs):
        ended[task_id] = (state, retval)

    celery_signals.task_postrun.connect(postrun, weak=False)
    try:
        first = hold.delay(7)
        assert hold.started.wait(10)
        ids = [send() for send in duplicates]
        deadline = time.monotonic() + 10
        while not all(i in ended for i in ids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(i in ended for i in ids), ended
    finally:
        celery_signals.task_postrun.disconnect(postrun)
    return first, {i: ended[i] for i in ids}


def _drained(app, timeout: float = 10) -> None:
    """Wait until the in-process worker has nothing reserved or running and its queue is empty."""
    from celery.worker import state as worker_state

    client = app.connection_for_read().default_channel.client
    queue = app.conf.task_default_queue
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = worker_state.active_requests or worker_state.reserved_requests
        if not busy and client.llen(queue) == 0:
            return
        time.sleep(0.02)
    raise AssertionError("the worker did not drain")


def _holding_task(app, name: str, base=SingletonTask):
    started, finish = threading.Event(), threading.Event()

    @app.task(base=base, name=name)
    def hold(x):
        started.set()
        finish.wait(10)
        return x

    hold.started, hold.finish = started, finish
    return hold


def test_a_skipped_duplicate_stores_nothing_over_skipped_and_sends_nothing_on(make_app):
    """A skip ends without a stored result, link callback, next chain step or chord part.

    The duplicate's run returns instead of raising ``Ignore`` (the cheap ending):
    each of these would follow a plain return unless the request forbids it.
    """
    app = make_app()
    hold = _holding_task(app, "t.skip_ends")
    ran: list[str] = []

    @app.task(name="t.after")
    def after(label):
        ran.append(label)

    with worker(app):
        first, ended = _skipped_while_held(
            app,
            hold,
            [
                lambda: hold.apply_async((7,), link=after.si("linked")).id,
                lambda: chain(hold.si(7), after.si("chained")).apply_async().parent.id,
                lambda: (
                    chord([hold.si(7)], after.si("chord body")).apply_async().parent.results[0].id
                ),
            ],
        )
        for task_id, (state, retval) in ended.items():
            result = hold.AsyncResult(task_id)
            assert result.state == SKIPPED, (task_id, result.state)
            assert result.info["holder"] == first.id
            # What the tracer logs as the run's return value names the holder.
            assert state == "SUCCESS" and first.id in retval
        hold.finish.set()
        assert first.get(timeout=10) == 7
        assert after.delay("sentinel").get(timeout=10) is None
        _drained(app)
    assert ran == ["sentinel"]


class _SeesSuccess(SingletonTask):
    """A task class whose hooks a plain return would reach."""

    abstract = True
    successes: ClassVar[list[str]] = []

    def on_success(self, retval, task_id, args, kwargs):
        self.successes.append(task_id)


@pytest.mark.parametrize("seen_by", ["on_success", "task_success", "eager"])
def test_a_skip_that_user_code_would_see_as_a_success_ends_with_ignore(make_app, seen_by):
    """An on_success override, a task_success receiver or an eager call: a skip is an Ignore."""
    app = make_app()
    hold = _holding_task(
        app, f"t.seen_{seen_by}", _SeesSuccess if seen_by == "on_success" else SingletonTask
    )
    successes: list[str] = []

    def on_task_success(sender=None, **kwargs):
        successes.append(sender.request.id)

    if seen_by == "task_success":
        celery_signals.task_success.connect(on_task_success, weak=False)
    try:
        with worker(app):
            if seen_by == "eager":
                first = hold.delay(7)
                assert hold.started.wait(10)
                eager = hold.apply((7,))
                assert eager.state == "IGNORED"
                ended = {}
            else:
                first, ended = _skipped_while_held(app, hold, [lambda: hold.delay(7).id])
            for task_id, (state, _) in ended.items():
                assert state == "IGNORED"
                assert hold.AsyncResult(task_id).state == SKIPPED
            hold.finish.set()
            assert first.get(timeout=10) == 7
    finally:
        celery_signals.task_success.disconnect(on_task_success)
    skipped = set(ended)
    assert not skipped & set(successes + _SeesSuccess.successes)


def test_raise_fails_with_lock_not_acquired_naming_the_holder(make_app):
    """Under raise, a duplicate fails with LockNotAcquired that names the holder."""
    app = make_app(redlock_on_conflict="raise")
    started, finish = threading.Event(), threading.Event()

    @app.task(base=SingletonTask, name="t.exclusive")
    def exclusive():
        started.set()
        finish.wait(10)

    with worker(app):
        first = exclusive.delay()
        assert started.wait(10)
        second = exclusive.delay()
        with pytest.raises(LockNotAcquired) as info:
            second.get(timeout=10)
        assert first.id in str(info.value)
        finish.set()
        first.get(timeout=10)


def test_requeue_keeps_id_arguments_queue_priority_and_headers(make_app):
    """A requeued duplicate is the same message again: id, args, queue, priority, headers."""
    app = make_app(redlock_on_conflict="requeue", redlock_requeue_delay=0.05)
    started, finish = threading.Event(), threading.Event()
    seen: list[dict] = []

    @app.task(base=SingletonTask, bind=True, name="t.serial")
    def serial(self, x, *, tag=None):
        seen.append(
            {
                "id": self.request.id,
                "args": list(self.request.args),
                "kwargs": dict(self.request.kwargs),
                "queue": self.request.delivery_info.get("routing_key"),
                "priority": self.request.delivery_info.get("priority"),
                "custom": (self.request.headers or {}).get("x_custom"),
                "requeues": requeues_of(self.request),
            }
        )
        started.set()
        finish.wait(10)
        return x

    with worker(app), received(redlock_signals.lock_contended) as events:
        first = serial.delay(1, tag="a")
        assert started.wait(10)
        second = serial.apply_async((1,), {"tag": "a"}, priority=3, headers={"x_custom": "kept"})
        wait_for(events, 1, task_id=second.id, action="requeue")
        finish.set()
        assert first.get(timeout=10) == 1
        assert second.get(timeout=20) == 1
    assert len(seen) == 2
    requeued = seen[1]
    assert requeued["id"] == second.id
    assert requeued["args"] == [1]
    assert requeued["kwargs"] == {"tag": "a"}
    assert requeued["queue"] == app.conf.task_default_queue
    assert requeued["priority"] == 3
    assert requeued["custom"] == "kept"
    assert requeued["requeues"] >= 1


@pytest.mark.parametrize("fair", [False, True])
def test_requeues_are_bounded_with_a_clear_final_failure(make_app, fair):
    """When requeues run out the task fails with LockNotAcquired, it does not vanish.

    Without the line, after exactly max_requeues requeues; in line (charged by its
    wait, polling faster), once its wait is what that many requeues take: never
    sooner, however many polls a loaded machine fits into that time.
    """
    app = make_app(
        redlock_on_conflict="requeue",
        redlock_requeue_delay=0.01,
        redlock_requeue_max_delay=0.02,
        redlock_max_requeues=3,
        redlock_fair=fair,
    )
    started, finish = threading.Event(), threading.Event()

    @app.task(base=SingletonTask, name="t.stuck", max_retries=0)
    def stuck():
        started.set()
        finish.wait(15)

    with worker(app), received(redlock_signals.lock_contended) as events:
        first = stuck.delay()
        assert started.wait(10)
        second = stuck.delay()
        with pytest.raises(LockNotAcquired, match="gave up after 3 requeues"):
            second.get(timeout=10)
        finish.set()
        first.get(timeout=10)
    # Three requeues (in line: polls for as long as three requeues' backoff, 0.01 +
    # 0.02 + 0.02 s from its arrival by the server's clock; the worker's events
    # come a little after each refusal, hence the margin), then the failure is
    # reported as what it is. tests/integration/celery/test_limits.py shows a
    # call in line outlasting max_requeues polls on a real worker.
    mine = [e for e in events if e["task_id"] == second.id]
    actions = [e["action"] for e in mine]
    if fair:
        assert actions[-1] == "raise" and set(actions[:-1]) == {"requeue"}
        assert "requeue" in actions and mine[-1]["at"] - mine[0]["at"] >= 0.04
    else:
        assert actions == ["requeue", "requeue", "requeue", "raise"]


def test_current_lock_is_per_request_in_a_thread_pool(make_app):
    """Concurrent runs of one task in threads each see their own lock, key and fence."""
    app = make_app()
    barrier = threading.Barrier(4, timeout=10)
    seen: dict[int, tuple] = {}

    @app.task(base=SingletonTask, name="t.parallel")
    def parallel(x):
        lease = current_lock()
        barrier.wait()  # all four hold their locks at once
        seen[x] = (lease.name, lease.fence, current_lock() is lease)
        return x

    with worker(app, concurrency=4):
        results = [parallel.delay(i) for i in range(4)]
        assert [r.get(timeout=15) for r in results] == [0, 1, 2, 3]
    assert {seen[i][0] for i in range(4)} == {parallel.lock_key_for(i) for i in range(4)}
    assert all(same for *_, same in seen.values())


def test_signals_report_acquire_contention_release_and_loss(make_app, redis_server):
    """lock_acquired, lock_contended, lock_released and lock_lost fire with their details."""
    app = make_app(redlock_ttl=0.6)
    events: list[tuple] = []
    started, finish = threading.Event(), threading.Event()
    client = redis_server.client()

    def recorder(name):
        def receive(sender=None, **kwargs):
            events.append((name, kwargs))

        return receive

    receivers = {name: recorder(name) for name in ("acquired", "contended", "released", "lost")}
    for name, receiver in receivers.items():
        getattr(redlock_signals, f"lock_{name}").connect(receiver, weak=False)

    @app.task(base=SingletonTask, name="t.signals")
    def watched():
        started.set()
        finish.wait(10)
        return current_lock().lost

    try:
        with worker(app):
            first = watched.delay()
            assert started.wait(10)
            watched.delay()
            deadline = time.monotonic() + 5
            while not any(n == "contended" for n, _ in events) and time.monotonic() < deadline:
                time.sleep(0.05)
            client.delete(watched.lock_key_for())  # steal it: the next renewal notices
            deadline = time.monotonic() + 5
            while not any(n == "lost" for n, _ in events) and time.monotonic() < deadline:
                time.sleep(0.05)
            finish.set()
            assert first.get(timeout=10) is True
    finally:
        for name, receiver in receivers.items():
            getattr(redlock_signals, f"lock_{name}").disconnect(receiver)
    by_name = {name: kwargs for name, kwargs in events}
    key = watched.lock_key_for()
    assert by_name["acquired"]["task_id"] == first.id and by_name["acquired"]["key"] == key
    assert by_name["contended"]["holder"] == first.id
    assert by_name["contended"]["action"] == "skip"
    assert by_name["lost"]["task_id"] == first.id and by_name["lost"]["fence"]
    assert by_name["released"]["owned"] is False


@pytest.fixture
def lock_store(redis_servers):
    (server,) = redis_servers(1)
    return server


@pytest.mark.parametrize("policy", ["requeue", "run", "raise"])
def test_redis_unreachable_at_acquire_follows_on_redis_error(make_app, lock_store, policy):
    """With the lock store down: requeue waits for it, run runs unprotected, raise fails."""
    app = make_app(
        redlock_url=lock_store.url + "?socket_connect_timeout=0.2&socket_timeout=0.2",
        redlock_on_redis_error=policy,
        redlock_requeue_delay=0.2,
        redlock_requeue_max_delay=0.4,
    )
    runs: list[bool] = []

    @app.task(base=SingletonTask, name=f"t.store_{policy}")
    def guarded():
        runs.append(current_lock() is not None)
        return "ran"

    lock_store.pause()  # connections open, nothing answered: the worst kind of down
    with worker(app), received(celery_signals.before_task_publish) as published:
        result = guarded.delay()
        if policy == "raise":
            with pytest.raises(LockError, match="unreachable"):
                result.get(timeout=10)
            assert runs == []
        elif policy == "run":
            assert result.get(timeout=10) == "ran"
            assert runs == [False]
        else:
            # The first delivery and two requeues met the outage (republished
            # under the same id), and none of them ran the task or ended it.
            deadline = time.monotonic() + 15
            while sum(e["headers"]["id"] == result.id for e in published) < 3:
                assert time.monotonic() < deadline, "the call was not requeued twice within 15 s"
                time.sleep(0.01)
            assert runs == []  # nothing ran unprotected
            assert result.state == "PENDING"  # and nothing was lost: it waits
            lock_store.resume()
            assert result.get(timeout=15) == "ran"
            assert runs == [True]


def test_requeues_run_out_on_a_store_that_stays_down_naming_the_outage(make_app, lock_store):
    """When requeues for an unreachable store run out, the failure says so, not "held by None"."""
    app = make_app(
        redlock_url=lock_store.url + "?socket_connect_timeout=0.2&socket_timeout=0.2",
        redlock_requeue_delay=0.05,
        redlock_requeue_max_delay=0.1,
        redlock_max_requeues=2,
    )

    @app.task(base=SingletonTask, name="t.store_stays_down", max_retries=0)
    def guarded():
        return "ran"

    lock_store.pause()
    try:
        with worker(app), pytest.raises(LockNotAcquired) as failed:
            guarded.delay().get(timeout=15)
    finally:
        lock_store.resume()
    message = str(failed.value)
    assert "gave up after 2 requeues" in message
    assert "kept failing" in message and "Timeout" in message
    assert "held by" not in message


def test_a_store_refusing_the_lock_command_is_not_called_unreachable(make_app, lock_store, caplog):
    """A server error (here an ACL without EVAL) is reported as a refusal, not as an outage."""
    app = make_app(redlock_url=lock_store.url, redlock_on_redis_error="raise")

    @app.task(base=SingletonTask, name="t.store_refuses")
    def guarded():
        return "ran"

    client = lock_store.client()
    client.execute_command("ACL", "SETUSER", "default", "-eval", "-evalsha")
    try:
        with (
            worker(app),
            caplog.at_level("WARNING", logger="celery_redlock.celery.guard"),
            pytest.raises(LockError, match="refused the lock command") as failed,
        ):
            guarded.delay().get(timeout=10)
    finally:
        client.execute_command("ACL", "SETUSER", "default", "+eval", "+evalsha")
    assert "unreachable" not in str(failed.value)
    assert any("refused the lock command" in r.getMessage() for r in caplog.records)


def test_a_redelivery_meeting_its_own_lock_waits_beyond_max_requeues(make_app):
    """Requeues of a copy whose own first delivery runs are not capped: no false FAILURE."""
    app = make_app(redlock_requeue_delay=0.02, redlock_requeue_max_delay=0.05)
    started, finish = threading.Event(), threading.Event()
    runs: list[str] = []

    @app.task(base=SingletonTask, bind=True, name="t.own", lock_max_requeues=1)
    def own(self):
        runs.append(self.request.id)
        started.set()
        finish.wait(10)
        return "first"

    signals = (redlock_signals.lock_contended, redlock_signals.lock_released)
    with worker(app), received(*signals) as events:
        first = own.delay()
        assert started.wait(10)
        own.apply_async(task_id=first.id)  # the broker delivering the same message again
        # Requeued far beyond lock_max_requeues=1, and never failed for it.
        wait_for(events, 4, sent_by="lock_contended", task_id=first.id, action="requeue")
        assert first.state != "FAILURE"
        finish.set()
        assert first.get(timeout=10) == "first"
        # The copy then takes the free lock, sees SUCCESS, is dropped, and releases.
        wait_for(events, 2, sent_by="lock_released", task_id=first.id)
    assert runs == [first.id]
    assert first.state == "SUCCESS"


def test_a_redelivery_taking_the_lock_before_the_result_is_stored_does_not_rerun(
    make_app, monkeypatch
):
    """The first delivery releases, then stores its result: a copy in between must not run."""
    app = make_app(redlock_requeue_delay=0.02, redlock_requeue_max_delay=0.05)
    started, finish = threading.Event(), threading.Event()
    runs: list[str] = []

    @app.task(base=SingletonTask, bind=True, name="t.own_slow_result")
    def own(self):
        runs.append(self.request.id)
        started.set()
        finish.wait(10)
        return "first"

    # Widen the gap between the release and the stored result to 0.5 s, far
    # more than the copy's requeue delay, so the copy certainly lands in it.
    # (On the class: each worker thread has a backend instance of its own.)
    backend_class = type(app.backend)
    store_result = backend_class.store_result

    def store_later(self, task_id, result, state, *args, **kwargs):
        if state == "SUCCESS":
            time.sleep(0.5)
        return store_result(self, task_id, result, state, *args, **kwargs)

    monkeypatch.setattr(backend_class, "store_result", store_later)
    signals = (redlock_signals.lock_contended, redlock_signals.lock_released)
    with worker(app), received(*signals) as events:
        first = own.delay()
        assert started.wait(10)
        own.apply_async(task_id=first.id)  # the broker delivering the same message again
        wait_for(events, 1, sent_by="lock_contended", task_id=first.id, action="requeue")
        finish.set()
        assert first.get(timeout=10) == "first"
        wait_for(events, 2, sent_by="lock_released", task_id=first.id)
    assert runs == [first.id]


def test_a_redelivery_whose_custom_id_holds_the_separator_knows_its_own_lock(
    make_app, redis_server
):
    """A task id holding "|" and "%" reads back intact: its redelivery waits, never skips."""
    app = make_app(redlock_requeue_delay=0.02, redlock_requeue_max_delay=0.05)
    started, finish = threading.Event(), threading.Event()
    runs: list[str] = []

    @app.task(base=SingletonTask, bind=True, name="t.own_custom_id")
    def own(self):
        runs.append(self.request.id)
        started.set()
        finish.wait(10)
        return "first"

    task_id = "order|42%7C|eu"
    signals = (redlock_signals.lock_contended, redlock_signals.lock_released)
    with worker(app), received(*signals) as events:
        first = own.apply_async(task_id=task_id)
        assert started.wait(10)
        own.apply_async(task_id=task_id)  # the broker delivering the same message again
        # Under the default lock_on_conflict="skip", only recognising its own lock
        # makes the copy requeue itself instead of being skipped.
        wait_for(events, 1, timeout=5, sent_by="lock_contended", task_id=task_id)
        contended = next(e for e in events if e["sent_by"] == "lock_contended")
        assert (contended["action"], contended["holder"]) == ("requeue", task_id)
        finish.set()
        assert first.get(timeout=10) == "first"
        wait_for(events, 2, sent_by="lock_released", task_id=task_id)
    assert runs == [task_id]
    assert lock_keys(redis_server) == []


def test_eager_call_that_cannot_lock_fails_instead_of_recursing(make_app, lock_store, caplog):
    """Eagerly, a requeue would re-run inside the call: it fails at once, never silently."""
    app = make_app(
        task_always_eager=True,
        redlock_url=lock_store.url + "?socket_timeout=0.2&socket_connect_timeout=0.2",
    )
    runs: list[int] = []

    @app.task(base=SingletonTask, name="t.eager")
    def eager(x):
        runs.append(x)

    lock_store.pause()
    try:
        with (
            caplog.at_level("WARNING", logger="celery_redlock"),
            pytest.raises(LockNotAcquired, match="cannot be requeued"),
        ):
            eager.delay(1).get()
    finally:
        lock_store.resume()
    # One attempt met the outage: the call did not run itself again to requeue.
    ours = [r for r in caplog.records if r.name.startswith("celery_redlock")]
    assert sum("unreachable" in r.getMessage() for r in ours) == 1
    assert runs == []
    eager.delay(2).get()
    assert runs == [2]


def test_distinct_completed_tasks_leave_only_the_fence_counter(make_app, redis_server):
    """200 tasks with distinct arguments run and finish: the lock store keeps the one
    fence counter for them, not a key per distinct call."""
    app = make_app()

    @app.task(base=SingletonTask, name="t.distinct")
    def distinct(x):
        return current_lock().fence

    with worker(app):
        results = [distinct.delay(n) for n in range(200)]
        fences = [result.get(timeout=30) for result in results]
    assert len(set(fences)) == 200
    assert redis_server.client().keys("redlock:*") == [b"redlock:v1:fence"]


@pytest.mark.parametrize(
    ("ttl", "conf", "low", "high"),
    [
        # Twice the silence limit or less: the reaper cannot act before the TTL ends.
        (10.0, {}, 9.7, 10.0),
        (120.0, {}, 118.5, 120.0),
        # Longer: the lease ends before the earliest release the reaper may make.
        (600.0, {}, 353.0, 360.0),
        (600.0, {"redlock_reaper_unresponsive_after": 200}, 487.0, 494.0),
        (600.0, {"redlock_reaper": False}, 353.0, 360.0),  # other workers may reap
    ],
)
def test_a_long_ttl_counts_lost_before_the_reaper_may_release_it(make_app, ttl, conf, low, high):
    """A holder cut off while it runs counts its lock lost before a reaper may take it away."""
    app = make_app(task_always_eager=True, **conf)

    @app.task(base=SingletonTask, name="t.remaining", lock_ttl=ttl)
    def remaining():
        return current_lock().remaining()

    assert low < remaining.delay().get() <= high
