"""Pure logic of the enqueue locks: options, reservation keys, delays, canvas calls."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_redlock import ConfigurationError
from celery_redlock.calls.options import MODES, LockOptions
from celery_redlock.celery.publish import is_canvas, publish_delay
from celery_redlock.celery.settings import check_settings, resolve
from celery_redlock.celery.window import reservation_key


class FakeTask:
    """Stands for a SingletonTask: only those take enqueue modes."""

    name = "proj.task"
    __redlock_guarded__ = True


def task_with(**attributes):
    return type("Task", (FakeTask,), {f"lock_{k}": v for k, v in attributes.items()})


def test_defaults():
    """The default window is while_executing; duplicates return the existing copy."""
    options = resolve(FakeTask, {})
    assert (options.mode, options.on_duplicate, options.enqueue_ttl) == (
        "while_executing",
        "return_existing",
        600.0,
    )
    assert LockOptions().mode == MODES[0]


def test_task_attribute_beats_setting():
    """lock_mode on the task wins over redlock_mode; redlock_mode over the default."""
    conf = {"redlock_mode": "until_executed", "redlock_on_duplicate": "raise"}
    assert resolve(task_with(mode="until_executing"), conf).mode == "until_executing"
    options = resolve(FakeTask, conf)
    assert (options.mode, options.on_duplicate) == ("until_executed", "raise")


@pytest.mark.parametrize(
    ("attributes", "conf", "source", "value"),
    [
        ({"mode": "until_done"}, {}, "proj.task.lock_mode", "until_done"),
        ({}, {"redlock_mode": 1}, "redlock_mode", 1),
        ({"on_duplicate": "drop"}, {}, "proj.task.lock_on_duplicate", "drop"),
        ({}, {"redlock_on_duplicate": "skip"}, "redlock_on_duplicate", "skip"),
        ({"enqueue_ttl": -1}, {}, "proj.task.lock_enqueue_ttl", -1),
        ({}, {"redlock_enqueue_ttl": "60"}, "redlock_enqueue_ttl", "60"),
    ],
)
def test_bad_values_name_setting_and_value(attributes, conf, source, value):
    """Each new option fails with a ConfigurationError naming where it came from and the value."""
    with pytest.raises(ConfigurationError) as info:
        resolve(task_with(**attributes), conf)
    assert (info.value.setting, info.value.value) == (source, value)
    assert source in str(info.value) and repr(value) in str(info.value)


def test_a_queue_cannot_take_an_enqueue_lock():
    """redlock_queues entries lock plain tasks at execution only: other modes are refused."""
    with pytest.raises(ConfigurationError) as info:
        check_settings(
            {"redlock_url": "redis://", "redlock_queues": {"q": {"mode": "until_executed"}}}
        )
    assert info.value.setting == "redlock_queues['q'].mode"
    check_settings(
        {"redlock_url": "redis://", "redlock_queues": {"q": {"mode": "while_executing"}}}
    )


REDLOCK_URLS = ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"]


def test_an_enqueue_mode_needs_a_single_server_store():
    """Reservations are single-server scripts: a Redlock store refuses them at worker start."""
    with pytest.raises(ConfigurationError) as info:
        check_settings({"redlock_url": REDLOCK_URLS, "redlock_mode": "until_executed"})
    assert (info.value.setting, info.value.value) == ("redlock_mode", "until_executed")
    check_settings({"redlock_url": REDLOCK_URLS, "redlock_mode": "while_executing"})
    check_settings({"redlock_url": "redis://", "redlock_mode": "until_executed"})


def test_a_task_in_an_enqueue_mode_refuses_a_redlock_store_when_bound():
    from celery import Celery

    from celery_redlock import SingletonTask

    app = Celery("modes-on-redlock", set_as_current=False)
    app.conf.redlock_url = REDLOCK_URLS

    @app.task(base=SingletonTask, lock_mode="until_and_while_executing", shared=False)
    def job() -> None:
        return None

    with pytest.raises(ConfigurationError) as info:
        app.finalize()
    assert info.value.setting.endswith(".lock_mode")
    assert info.value.value == "until_and_while_executing"


def test_reservation_keys_share_the_lock_keys_slot():
    """until_executed reserves the lock key; the others a sibling inside the same hash tag."""
    key = "redlock:v1:{proj.task:abc}"
    assert reservation_key("until_executed", key) == key
    for mode in ("until_executing", "until_and_while_executing"):
        sibling = reservation_key(mode, key)
        assert sibling != key and sibling.startswith(key)


def test_publish_delay():
    """countdown, aware eta, ISO eta, naive eta (the later reading), and none."""
    now = 1_000_000.0
    assert publish_delay({}, now) == 0.0
    assert publish_delay({"countdown": 5}, now) == 5.0
    assert publish_delay({"countdown": -3}, now) == 0.0
    eta = datetime.fromtimestamp(now, timezone.utc) + timedelta(seconds=7)
    assert publish_delay({"eta": eta}, now) == pytest.approx(7)
    assert publish_delay({"eta": eta.isoformat()}, now) == pytest.approx(7)
    assert publish_delay({"eta": eta - timedelta(seconds=60)}, now) == 0.0
    naive = eta.replace(tzinfo=None)
    assert publish_delay({"eta": naive}, now) >= 7 - 1e-6


def test_publish_delay_reads_countdown_and_eta_as_celery_does():
    """countdown=0 defers to eta, as in Celery; 'Z' and junk etas parse without raising."""
    now = 1_000_000.0
    eta = datetime.fromtimestamp(now, timezone.utc) + timedelta(seconds=30)
    assert publish_delay({"countdown": 0, "eta": eta}, now) == pytest.approx(30)
    assert publish_delay({"countdown": None, "eta": eta}, now) == pytest.approx(30)
    zulu = eta.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert publish_delay({"eta": zulu}, now) == pytest.approx(30)
    assert publish_delay({"eta": "not a date"}, now) == 0.0


def test_until_and_while_executing_requeues_a_conflict_by_default():
    """The one waiting copy is never skipped unless lock_on_conflict says so."""
    assert resolve(task_with(mode="until_and_while_executing"), {}).on_conflict == "requeue"
    conf = {"redlock_mode": "until_and_while_executing"}
    assert resolve(FakeTask, conf).on_conflict == "requeue"
    assert resolve(FakeTask, {**conf, "redlock_on_conflict": "skip"}).on_conflict == "skip"
    explicit = task_with(mode="until_and_while_executing", on_conflict="raise")
    assert resolve(explicit, {}).on_conflict == "raise"
    for mode in ("while_executing", "until_executing", "until_executed"):
        assert resolve(task_with(mode=mode), {}).on_conflict == "skip"


@pytest.mark.parametrize("option", ["key", "key_prefix", "enqueue_ttl", "on_duplicate"])
def test_a_queue_entry_cannot_change_what_apply_async_reserves(option):
    """Enqueue modes: a locked queue's key, prefix, enqueue TTL or duplicate policy is refused."""
    value = {"key": ["x"], "key_prefix": "q", "enqueue_ttl": 5, "on_duplicate": "raise"}[option]
    with pytest.raises(ConfigurationError) as info:
        resolve(task_with(mode="until_executed"), {}, "q", {option: value})
    assert (info.value.setting, info.value.value) == (f"redlock_queues['q'].{option}", value)
    resolve(task_with(mode="while_executing"), {}, "q", {option: value})
    resolve(task_with(mode="until_executed"), {}, "q", {"on_conflict": "raise", "ttl": 3})


def test_canvas_calls():
    """A chain, callbacks, errbacks, group or chord membership make a call part of a canvas."""
    assert not is_canvas({})
    assert not is_canvas({"link": None, "chain": [], "countdown": 3})
    for name in ("link", "link_error", "chain", "chord", "group_id"):
        assert is_canvas({name: ["x"]})
