"""Option resolution: task attribute > app setting > default, with errors naming the source."""

from __future__ import annotations

import pytest
from celery.app.task import Context

from celery_redlock import ConfigurationError
from celery_redlock.calls.decisions import requeue_delay
from celery_redlock.calls.options import LockOptions
from celery_redlock.celery.guard import TaskGuard
from celery_redlock.celery.messages import REQUEUES_HEADER, SELF_HEADER, requeues_of
from celery_redlock.celery.settings import lock_url, resolve, validate_settings


class FakeTask:
    name = "proj.task"


def task_with(**attributes):
    return type("Task", (FakeTask,), {f"lock_{k}": v for k, v in attributes.items()})


def test_defaults_apply_without_settings():
    """With nothing set, the documented defaults apply."""
    assert resolve(FakeTask, {}) == LockOptions()


def test_task_attribute_beats_app_setting_beats_default():
    """One resolution order for every option."""
    conf = {"redlock_ttl": 20, "redlock_on_conflict": "requeue"}
    options = resolve(task_with(ttl=5), conf)
    assert options.ttl == 5.0
    assert options.on_conflict == "requeue"
    assert options.on_redis_error == "requeue"


@pytest.mark.parametrize(
    ("attributes", "conf", "source"),
    [
        ({"ttl": 0}, {}, "proj.task.lock_ttl"),
        ({}, {"redlock_ttl": "30"}, "redlock_ttl"),
        ({"on_conflict": "drop"}, {}, "proj.task.lock_on_conflict"),
        ({}, {"redlock_on_redis_error": "ignore"}, "redlock_on_redis_error"),
        ({"requeue_jitter": 2}, {}, "proj.task.lock_requeue_jitter"),
        ({"max_requeues": -1}, {}, "proj.task.lock_max_requeues"),
        ({"key": 5}, {}, "proj.task.lock_key"),
        ({}, {"redlock_key_prefix": "a{b}"}, "redlock_key_prefix"),
        ({"requeue_delay": 10, "requeue_max_delay": 1}, {}, "proj.task.lock_requeue_max_delay"),
        # The bound the task did set is the one named, not the default it crossed.
        ({"requeue_delay": 120}, {}, "proj.task.lock_requeue_delay"),
        ({}, {"redlock_requeue_max_delay": 0.5}, "redlock_requeue_max_delay"),
        ({}, {"redlock_ttl": float("nan")}, "redlock_ttl"),
        ({"enqueue_ttl": float("inf")}, {}, "proj.task.lock_enqueue_ttl"),
        ({"requeue_delay": float("-inf")}, {}, "proj.task.lock_requeue_delay"),
    ],
)
def test_bad_values_name_their_source(attributes, conf, source):
    """A bad value raises ConfigurationError naming the attribute or setting and the value."""
    with pytest.raises(ConfigurationError) as info:
        resolve(task_with(**attributes), conf)
    assert info.value.setting == source
    assert source in str(info.value)


def test_misspelt_setting_is_rejected():
    """A redlock_* setting that does not exist is an error, not silently ignored."""
    with pytest.raises(ConfigurationError, match="redlock_tll"):
        validate_settings({"redlock_tll": 5, "broker_url": "x"})
    validate_settings({"redlock_ttl": 5, "redlock_url": "redis://"})


@pytest.mark.parametrize(
    ("misspelt", "closest"),
    [
        ("redlock_tll", "redlock_ttl"),
        ("REDLOCK_TTL", "redlock_ttl"),
        ("redlock_on_conflcit", "redlock_on_conflict"),
        ("redlock_queue", "redlock_queues"),
    ],
)
def test_a_misspelt_setting_names_the_closest_one(misspelt, closest):
    """The error points at the setting meant, not at a list of every setting."""
    with pytest.raises(ConfigurationError) as info:
        validate_settings({misspelt: 5})
    assert info.value.setting == misspelt
    assert str(info.value).endswith(f"is not a setting; did you mean {closest}?")


def test_a_setting_close_to_none_lists_the_known_ones():
    """Without a close match, the message lists every setting."""
    with pytest.raises(ConfigurationError, match="is not a setting; known: redlock_enqueue_ttl, "):
        validate_settings({"redlock_xyzzy": 5})


@pytest.mark.parametrize(
    ("conf", "url"),
    [
        ({"redlock_url": "redis://h:1/2"}, "redis://h:1/2"),
        ({"broker_url": "redis://b:6379/0"}, "redis://b:6379/0"),
        ({"broker_url": "rediss://b:6379/0;redis://c:6379/0"}, "rediss://b:6379/0"),
        ({"broker_url": ["unix:///tmp/r.sock"]}, "unix:///tmp/r.sock"),
    ],
)
def test_lock_url_falls_back_to_a_redis_broker(conf, url):
    """redlock_url wins; otherwise a Redis broker URL serves."""
    assert lock_url(conf) == url


def test_lock_url_without_redis_anywhere_is_a_clear_error():
    """An AMQP broker and no redlock_url fails naming the setting, password redacted."""
    with pytest.raises(ConfigurationError) as info:
        lock_url({"broker_url": "amqp://guest:secret@rabbit//"})
    assert info.value.setting == "redlock_url"
    assert "secret" not in str(info.value)
    with pytest.raises(ConfigurationError, match="redis://"):
        lock_url({"redlock_url": "http://x"})


@pytest.mark.parametrize(
    ("attempt", "draw", "expected"),
    [(1, 0.0, 1.0), (2, 0.0, 2.0), (3, 0.0, 4.0), (7, 0.0, 60.0), (10_000, 0.0, 60.0)],
)
def test_requeue_delay_doubles_up_to_the_cap(attempt, draw, expected):
    """Requeue delays grow exponentially, never past the cap, even after many requeues."""
    assert requeue_delay(LockOptions(requeue_jitter=0.5), attempt, draw) == expected


def test_requeue_jitter_takes_off_at_most_its_share():
    """Jitter shortens a delay by at most requeue_jitter of it."""
    options = LockOptions(requeue_delay=2.0, requeue_jitter=0.25)
    assert requeue_delay(options, 1, 0.999999) == pytest.approx(1.5, abs=1e-5)
    assert requeue_delay(LockOptions(requeue_jitter=0.0), 1, 0.9) == 1.0


def test_flag_settings_accept_only_bools():
    """redlock_recover_stale / redlock_stats: a bool or unset; anything else names the setting."""
    from celery_redlock.celery.settings import flag

    assert flag({}, "redlock_stats", True) is True
    assert flag({"redlock_recover_stale": False}, "redlock_recover_stale", True) is False
    with pytest.raises(ConfigurationError, match="redlock_recover_stale"):
        flag({"redlock_recover_stale": "yes"}, "redlock_recover_stale", True)
    validate_settings({"redlock_recover_stale": True, "redlock_stats": False})


class FakeSingletonTask(FakeTask):
    __redlock_guarded__ = True


def test_an_app_wide_enqueue_mode_leaves_plain_tasks_locking_while_executing():
    """redlock_mode is for SingletonTask: a plain task locked by its queue cannot reserve."""
    conf = {"redlock_mode": "until_executing"}
    assert resolve(FakeTask, conf, "q", {}).mode == "while_executing"
    assert resolve(FakeSingletonTask, conf, "q", {}).mode == "until_executing"


def test_a_plain_task_asking_for_an_enqueue_mode_is_refused():
    """lock_mode on a task without base=SingletonTask could never be honoured: an error."""
    plain = task_with(mode="until_executed")
    with pytest.raises(ConfigurationError, match="SingletonTask") as info:
        resolve(plain, {}, "q", {})
    assert info.value.setting == "proj.task.lock_mode"


@pytest.mark.parametrize(
    ("header", "retries", "expected"),
    [
        (None, 0, 0),
        ([0, 3], 0, 3),
        ([0, 3], 1, 0),  # a Celery retry copied the header: its own count starts at 0
        ([2, 1], 2, 1),
        (4, 1, 4),  # the plain count an earlier version wrote
    ],
)
def test_requeues_are_counted_per_attempt(header, retries, expected):
    """max_requeues bounds one attempt; a retry's copied header does not use it up."""
    headers = {} if header is None else {REQUEUES_HEADER: header}
    assert requeues_of(Context(headers=headers, retries=retries)) == expected


def test_a_retry_of_a_copy_that_met_itself_is_not_taken_for_that_copy():
    """The "met its own lock" mark belongs to one attempt: a retry does not recheck the result."""
    marked = Context(headers={SELF_HEADER: 0}, retries=0)
    assert TaskGuard._met_itself(marked)
    assert not TaskGuard._met_itself(Context(headers={SELF_HEADER: 0}, retries=1))
    assert not TaskGuard._met_itself(Context(headers={}, retries=0))
