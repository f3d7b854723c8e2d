"""Options of the debounce, keep-the-newest and once-per-period windows: what each refuses."""

from __future__ import annotations

import pytest

from celery_redlock import ConfigurationError
from celery_redlock.calls.options import Keep, Mode
from celery_redlock.calls.windows import keeps_newest
from celery_redlock.celery.settings import resolve
from celery_redlock.celery.window import reservation_key


class FakeTask:
    """Stands for a SingletonTask: only those take the windows."""

    name = "proj.task"
    __redlock_guarded__ = True


def task_with(**attributes):
    return type("Task", (FakeTask,), {f"lock_{k}": v for k, v in attributes.items()})


def test_the_new_windows_resolve():
    """Debounce (requeue by default), keep latest, and until_expired resolve with their options."""
    debounce = resolve(task_with(mode="debounce", debounce=1, debounce_max_wait=1.5), {})
    assert (debounce.mode, debounce.debounce, debounce.debounce_max_wait) == (
        Mode.DEBOUNCE,
        1.0,
        1.5,
    )
    assert debounce.on_conflict == "requeue" and keeps_newest(debounce)
    latest = resolve(task_with(mode="until_and_while_executing", keep="latest"), {})
    assert latest.keep is Keep.LATEST and keeps_newest(latest)
    first = resolve(task_with(mode="until_and_while_executing"), {})
    assert first.keep is Keep.FIRST and not keeps_newest(first)
    period = resolve(task_with(mode="until_expired", period=2), {})
    assert period.period == 2.0 and not keeps_newest(period)
    assert reservation_key("until_expired", "k") == "k:period"


@pytest.mark.parametrize(
    ("attributes", "option", "value"),
    [
        ({"mode": "debounce", "debounce": 0}, "debounce", 0),
        ({"mode": "debounce", "debounce": -1}, "debounce", -1),
        ({"mode": "debounce", "debounce": "1s"}, "debounce", "1s"),
        ({"mode": "debounce", "debounce": True}, "debounce", True),
        ({"mode": "debounce"}, "debounce", None),
        ({"mode": "until_executed", "debounce": 1}, "debounce", 1.0),
        ({"mode": "debounce", "debounce": 2, "debounce_max_wait": 1}, "debounce_max_wait", 1.0),
        ({"mode": "while_executing", "debounce_max_wait": 3}, "debounce_max_wait", 3.0),
        ({"mode": "until_and_while_executing", "keep": "last"}, "keep", "last"),
        ({"mode": "until_executed", "keep": "latest"}, "keep", "latest"),
        ({"mode": "debounce", "debounce": 1, "keep": "latest"}, "keep", "latest"),
        ({"mode": "until_executed", "period": 2}, "period", 2.0),
        ({"mode": "until_expired"}, "period", None),
        ({"mode": "until_expired", "period": 0}, "period", 0),
    ],
)
def test_bad_window_options_name_the_option(attributes, option, value):
    """Each bad value or misfit raises one ConfigurationError naming the task attribute."""
    with pytest.raises(ConfigurationError) as info:
        resolve(task_with(**attributes), {})
    assert (info.value.setting, info.value.value) == (f"proj.task.lock_{option}", value)


def test_a_queue_entry_cannot_set_the_window_options():
    """A queue entry cannot debounce or keep the latest: the publisher knows no queue."""
    with pytest.raises(ConfigurationError) as info:
        resolve(task_with(mode="while_executing"), {}, "q", {"debounce": 1})
    assert info.value.setting == "redlock_queues['q'].debounce"


@pytest.mark.parametrize(
    "window",
    [{"mode": "debounce", "debounce": 1}, {"mode": "until_and_while_executing", "keep": "latest"}],
)
def test_the_newest_call_waits_whatever_the_app_wide_conflict_policy(window):
    """An app-wide skip is meant for the other windows: the newest copy still waits and runs."""
    options = resolve(task_with(**window), {"redlock_on_conflict": "skip"})
    assert options.on_conflict == "requeue"


@pytest.mark.parametrize("policy", ["skip", "raise"])
@pytest.mark.parametrize(
    "window",
    [{"mode": "debounce", "debounce": 1}, {"mode": "until_and_while_executing", "keep": "latest"}],
)
def test_a_task_that_would_drop_its_newest_call_is_refused(window, policy):
    """Skipping or failing the newest copy would drop every call it replaced: refused by name."""
    with pytest.raises(
        ConfigurationError, match=r"proj\.task\.lock_on_conflict.*must be 'requeue'"
    ):
        resolve(task_with(on_conflict=policy, **window), {})


def test_a_first_call_window_keeps_the_app_wide_conflict_policy():
    """keep='first' is not affected: the app-wide skip still applies to it."""
    options = resolve(task_with(mode="until_executing"), {"redlock_on_conflict": "skip"})
    assert options.on_conflict == "skip"


def test_a_locked_queues_conflict_policy_does_not_reach_the_newest_call():
    """A redlock_queues entry's skip is for the queue's tasks: a debounced task still waits."""
    options = resolve(
        task_with(mode="debounce", debounce=1), {}, queue="q", queue_options={"on_conflict": "skip"}
    )
    assert options.on_conflict == "requeue"
