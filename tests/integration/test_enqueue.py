"""Enqueue locks on a private redis-server: the scripts' contracts and the cost of a publish.

The publishing side needs no worker: messages go to an in-memory broker and
the lock store is a real redis-server, so every command it receives is counted.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redlock import ConfigurationError, DuplicateTask, SingletonTask, current_lock
from celery_redlock.celery.messages import RESERVATION_HEADER
from celery_redlock.celery.window import reservation_key
from celery_redlock.core.holder import Holder
from celery_redlock.core.lock import fence_key_for
from celery_redlock.core.scripts import RELEASE
from celery_redlock.core.window_scripts import DEQUEUE, HANDOVER, RESERVE

MODES = ("while_executing", "until_executing", "until_executed", "until_and_while_executing")


# -- scripts ---------------------------------------------------------------------------


def test_reserve_takes_a_free_key_and_names_the_holder_of_a_taken_one(r: redis.Redis) -> None:
    """RESERVE: SET NX PX, or the holder's PTTL and value; the same value again is idempotent."""
    assert RESERVE(r, ("k",), ("a", 5000, "")) == 1
    assert 4000 < r.pttl("k") <= 5000
    pttl, held = RESERVE(r, ("k",), ("b", 5000, ""))
    assert held == b"a" and 0 < pttl <= 5000
    assert RESERVE(r, ("k",), ("a", 9000, "")) == 1  # a resent reservation
    assert r.pttl("k") > 5000


def test_reserve_replaces_only_the_value_it_names(r: redis.Redis) -> None:
    """A republishing task renews its own reservation; another value stays untouched."""
    r.set("k", "old", px=5000)
    assert isinstance(RESERVE(r, ("k",), ("new", 8000, "other")), list)
    assert r.get("k") == b"old"
    assert RESERVE(r, ("k",), ("new", 8000, "old")) == 1
    assert r.get("k") == b"new" and r.pttl("k") > 5000


def test_dequeue(r: redis.Redis) -> None:
    """DEQUEUE deletes only the message's own reservation and reports any other holder."""
    assert DEQUEUE(r, ("q",), ("",)) == 0
    r.set("q", "mine", px=5000)
    pttl, held = DEQUEUE(r, ("q",), ("theirs",))
    assert held == b"mine" and pttl > 0 and r.exists("q")
    assert DEQUEUE(r, ("q",), ("mine",)) == 1
    assert not r.exists("q")


def test_handover_to_a_sibling_lock_is_one_step(r: redis.Redis) -> None:
    """until_and_while_executing: the reservation goes and the lock comes in the same call."""
    key, queued = "{t}:k", "{t}:k:queued"
    r.set(queued, "R1", px=60000)
    status, fence, found = HANDOVER(r, (key, fence_key_for(key), queued), ("E1", 3000, 60000, "R1"))
    assert (status, found) == (1, 1) and fence > 0
    assert r.get(key) == b"E1" and 2000 < r.pttl(key) <= 3000
    assert not r.exists(queued)
    # A second copy, its reservation in place, meets the running one: nothing changes.
    r.set(queued, "R2", px=60000)
    status, pttl, held, found = HANDOVER(
        r, (key, fence_key_for(key), queued), ("E2", 3000, 60000, "R2")
    )
    assert (status, held, found) == (0, b"E1", 1) and pttl > 0
    assert r.get(queued) == b"R2"


def test_handover_in_place_and_fences_increase(r: redis.Redis) -> None:
    """until_executed: the reservation itself becomes the lock; a lapsed one is reported."""
    key = "{t}:k"
    r.set(key, "R1", px=60000)
    _, first, found = HANDOVER(r, (key, fence_key_for(key), key), ("E1", 3000, 60000, "R1"))
    assert found == 1 and r.get(key) == b"E1" and r.pttl(key) <= 3000
    held = HANDOVER(r, (key, fence_key_for(key), key), ("E2", 3000, 60000, "R2"))[2]
    assert held == b"E1"
    r.delete(key)
    _, second, found = HANDOVER(r, (key, fence_key_for(key), key), ("E3", 3000, 60000, "R3"))
    assert found == 0 and second > first
    assert RELEASE(r, (key,), ("E3", "0")) == 1


# -- the publishing side -------------------------------------------------------------


@pytest.fixture
def app(redis_server: Any) -> Celery:
    app = Celery(f"enqueue-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(broker_url="memory://", redlock_url=redis_server.url)
    return app


def singleton(app: Celery, mode: str, **options: Any) -> Any:
    @app.task(
        base=SingletonTask, shared=False, name=f"t.{mode}", lock_mode=mode, bind=True, **options
    )
    def task(self: Any, x: Any) -> Any:
        lease = current_lock()
        return [x, lease.fence if lease is not None else None]

    return task


def commands(r: redis.Redis) -> dict[str, int]:
    stats = r.info("commandstats")
    return {name: int(stat["calls"]) for name, stat in stats.items()}


@pytest.mark.parametrize("mode", MODES)
def test_round_trips_per_publish(app: Celery, r: redis.Redis, mode: str) -> None:
    """while_executing publishes with no Redis command; the enqueue modes with exactly one."""
    task = singleton(app, mode)
    task.delay(0)  # loads the script (EVALSHA -> NOSCRIPT -> EVAL) and connects
    r.config_resetstat()
    for x in range(1, 11):
        task.delay(x)  # ten new reservations
    for _ in range(10):
        task.delay(1)  # ten duplicates
    used = commands(r)
    used.pop("cmdstat_info", None)
    used.pop("cmdstat_config|resetstat", None)
    if mode == "while_executing":
        assert used == {}
    else:
        # commandstats also counts the commands a script runs inside the server.
        assert used.pop("cmdstat_evalsha") == 20
        assert set(used) <= {"cmdstat_get", "cmdstat_set", "cmdstat_pttl"}


def test_reservation_value_is_a_holder_naming_the_task(app: Celery, r: redis.Redis) -> None:
    """The enqueue lock's value parses as a Holder of the new task id, with countdown + TTL."""
    task = singleton(app, "until_executed", lock_enqueue_ttl=30)
    result = task.apply_async((5,), countdown=100)
    key = task.lock_key_for(5)
    holder = Holder.parse(r.get(key))
    assert holder is not None and holder.task_id == result.id
    assert 125_000 < r.pttl(key) <= 130_000


def test_explicit_same_task_id_is_reentrant(app: Celery, r: redis.Redis) -> None:
    """A second publish with the holder's own task id goes out and leaves the key as it was."""
    task = singleton(app, "until_executed", lock_on_duplicate="raise")
    first = task.delay(1)
    value = r.get(task.lock_key_for(1))
    again = task.apply_async((1,), task_id=first.id)
    assert again.id == first.id
    assert r.get(task.lock_key_for(1)) == value
    with pytest.raises(DuplicateTask) as info:
        task.delay(1)
    assert info.value.task_id == first.id


def test_a_custom_task_id_with_the_separator_is_the_duplicate_callers_get(
    app: Celery, r: redis.Redis
) -> None:
    """A "|" in a task id survives its reservation: republishing is reentrant, duplicates get it."""
    task = singleton(app, "until_executed")
    task.apply_async((1,), task_id="order|42")
    value = r.get(task.lock_key_for(1))
    assert task.apply_async((1,), task_id="order|42").id == "order|42"
    assert r.get(task.lock_key_for(1)) == value
    assert task.delay(1).id == "order|42"


def test_eager_calls_run_under_the_lock_and_leave_nothing(app: Celery, r: redis.Redis) -> None:
    """task_always_eager: no reservation, the execution side still locks, nothing remains."""
    app.conf.task_always_eager = True
    for mode in MODES[1:]:
        task = singleton(app, mode)
        value, fence = task.delay(3).get()
        assert value == 3
        assert (fence is None) == (mode == "until_executing")
        key = task.lock_key_for(3)
        assert not r.exists(key) and not r.exists(reservation_key(mode, key))


def test_header_name_is_a_celery_custom_header() -> None:
    """Custom headers reach the worker's request only when not a protocol field."""
    assert RESERVATION_HEADER.startswith("x_")


@pytest.mark.parametrize(
    ("attributes", "setting"),
    [
        ({"lock_mode": "always"}, "t.bad.lock_mode"),
        ({"lock_on_duplicate": "ignore"}, "t.bad.lock_on_duplicate"),
        ({"lock_enqueue_ttl": 0}, "t.bad.lock_enqueue_ttl"),
    ],
)
def test_bad_options_fail_when_the_task_is_bound(
    app: Celery, attributes: dict[str, Any], setting: str
) -> None:
    """A bad lock_mode, lock_on_duplicate or lock_enqueue_ttl names itself at registration."""
    with pytest.raises(ConfigurationError) as info:

        @app.task(base=SingletonTask, shared=False, name="t.bad", **attributes)
        def bad() -> None:
            pass

        app.finalize()
        _ = app.tasks["t.bad"]
    assert info.value.setting == setting
