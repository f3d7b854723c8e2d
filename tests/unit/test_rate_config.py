"""Rate limits as written by users: parsing, and bad values failing at bind naming the option."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery

from celery_redlock import ConfigurationError, SingletonTask
from celery_redlock.calls.decisions import rate_action, rate_countdown, rate_wait
from celery_redlock.calls.options import LockOptions, validate
from celery_redlock.core.rate import Rate, RateVerdict, parse_rate


@pytest.mark.parametrize(
    ("text", "limit", "window"),
    [
        ("20/s", 20, 1.0),
        ("100/m", 100, 60.0),
        ("5/h", 5, 3600.0),
        ("10/5s", 10, 5.0),
        ("3/1.5m", 3, 90.0),
        (" 7 / 2 s ", 7, 2.0),
    ],
)
def test_rates_read_as_count_per_window(text, limit, window):
    """Every documented spelling gives its count and window in seconds."""
    rate = parse_rate(text)
    assert (rate.limit, rate.window) == (limit, window)


@pytest.mark.parametrize("bad", ["fast", "0/s", "10", "10/0s", "-1/s", "1/d", 20, "1.5/s"])
def test_bad_rates_are_refused_naming_the_option(bad):
    """A value that is not a positive count per window fails, naming where it came from."""
    with pytest.raises(ConfigurationError) as error:
        validate("rate", bad, "proj.task.lock_rate")
    assert error.value.setting == "proj.task.lock_rate"


def test_no_rate_by_default():
    """Without ``lock_rate`` a task has no rate limit and no rate key."""
    assert LockOptions().rate is None
    assert validate("rate", None) is None


def test_a_rate_requeue_comes_back_when_the_slot_frees_plus_jitter():
    """The countdown is the exact wait, plus at most ``requeue_jitter`` of the window."""
    options = LockOptions(rate=Rate(20, 1.0), requeue_jitter=0.5)
    verdict = RateVerdict(False, 0.25, 20, 20)
    assert rate_countdown(options, verdict, 0.0) == pytest.approx(0.251)
    assert rate_countdown(options, verdict, 0.999) == pytest.approx(0.251 + 0.4995)


def bound(**options):
    app = Celery(f"rate-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.redlock_url = "redis://127.0.0.1:6379/0"

    @app.task(base=SingletonTask, name="rates.call", **options)
    def call(account, page=1):
        return page

    app.finalize()
    return call


@pytest.mark.parametrize("bad", ["fast", "0/s", "twenty/s"])
def test_a_bad_lock_rate_fails_when_the_task_is_bound(bad):
    """``lock_rate="fast"`` or ``"0/s"`` is a ConfigurationError at bind naming ``lock_rate``."""
    with pytest.raises(ConfigurationError) as error:
        bound(lock_rate=bad)
    assert error.value.setting == "rates.call.lock_rate"
    assert repr(bad) in str(error.value) or bad in str(error.value)


def test_a_rate_key_naming_a_missing_argument_fails_when_the_task_is_bound():
    """``lock_rate_key`` naming an argument the task does not take is refused, naming the option."""
    with pytest.raises(ConfigurationError) as error:
        bound(lock_rate="5/s", lock_rate_key=["acount"])
    assert error.value.setting == "rates.call.lock_rate_key"
    assert "acount" in str(error.value)


def test_a_rate_in_an_enqueue_mode_is_refused():
    """Rate limits apply at execution: an enqueue mode with ``lock_rate`` fails at bind."""
    with pytest.raises(ConfigurationError) as error:
        bound(lock_rate="5/s", lock_mode="until_executed")
    assert error.value.setting == "rates.call.lock_rate"


def test_a_rate_on_redlock_masters_is_refused():
    """A Redlock store cannot keep one exact window: refused at bind, naming ``lock_rate``."""
    app = Celery(f"rate-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.redlock_url = [
        "redis://127.0.0.1:1/0",
        "redis://127.0.0.1:2/0",
        "redis://127.0.0.1:3/0",
    ]

    @app.task(base=SingletonTask, name="rates.call", lock_rate="5/s")
    def call(account):
        return account

    with pytest.raises(ConfigurationError) as error:
        app.finalize()
    assert error.value.setting == "rates.call.lock_rate"


def test_rate_keys_follow_lock_rate_key():
    """Calls sharing ``lock_rate_key`` arguments share one rate key under the prefix."""
    from celery_redlock.celery.guards import guard_for

    call = bound(lock_rate="5/s", lock_rate_key=["account"])
    keys = guard_for(call._get_current_object()).rate_keys
    assert keys is not None
    assert keys.key_for((7,), {"page": 1}) == keys.key_for((7,), {"page": 2})
    assert keys.key_for((7,), {}) != keys.key_for((8,), {})
    assert keys.key_for((7,), {}).startswith("redlock:rate:v1:{rates.call:")


@pytest.mark.parametrize(
    ("on_conflict", "can_requeue", "action"),
    [
        ("skip", True, "skip"),
        ("requeue", True, "requeue"),
        ("requeue", False, "raise"),
        ("raise", True, "raise"),
        ("wait", True, "wait"),
    ],
)
def test_a_call_over_its_rate_follows_on_conflict(on_conflict, can_requeue, action):
    """Every integration reads the same answer; a call that cannot be requeued raises."""
    assert rate_action(on_conflict, can_requeue) == action


def test_a_waiting_call_sleeps_exactly_the_wait_within_its_timeout():
    """The wait is the verdict's; one that would end past the timeout is not begun."""
    verdict = RateVerdict(False, 0.75, 2, 2)
    assert rate_wait(verdict, waited=0.0, timeout=None) == 0.75
    assert rate_wait(verdict, waited=0.2, timeout=1.0) == 0.75
    assert rate_wait(verdict, waited=0.3, timeout=1.0) is None


@pytest.mark.parametrize("decorate", ["singleton", "singleton_job"])
def test_a_rate_key_without_a_rate_is_refused_by_the_decorator_and_rq(decorate):
    """Neither has another source of a rate: a rate_key alone is a slip, named at once."""
    import celery_redlock
    import celery_redlock.rq

    decorator = getattr(celery_redlock if decorate == "singleton" else celery_redlock.rq, decorate)

    def report(account):
        return account

    with pytest.raises(ConfigurationError, match="rate_key") as error:
        decorator(rate_key=["account"])(report)
    assert error.value.setting == "rate_key"
