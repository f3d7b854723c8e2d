"""A limit of holders is checked once, where it is given, and refused with the option named."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from redis.crc import key_slot

from celery_redlock import ConfigurationError, Semaphore, SingletonTask, singleton
from celery_redlock.celery.settings import check_settings, resolve
from celery_redlock.core.lock_options import fence_key_for
from celery_redlock.core.semaphore_scripts import semaphore_keys
from celery_redlock.core.store import LockStore, parse_store
from celery_redlock.rq import singleton_job

BAD_LIMITS = [0, -1, 2.5, "3", True, None, 10_001]
REDLOCK_URLS = ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"]


def bound(conf: dict[str, Any], **options: Any) -> None:
    """Bind a SingletonTask with ``options`` to an app configured with ``conf``."""
    app = Celery(f"limits-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update({"redlock_url": "redis://127.0.0.1:6379/0", **conf})

    @app.task(base=SingletonTask, name="proj.limited", shared=False, **options)
    def limited() -> None:
        return None

    app.finalize()


@pytest.mark.parametrize("value", [v for v in BAD_LIMITS if v is not None])
def test_a_bad_lock_limit_fails_at_bind_naming_the_task_option(value: Any) -> None:
    """lock_limit=0, negative, non-integer or too large: ConfigurationError at bind."""
    with pytest.raises(ConfigurationError) as info:
        bound({}, lock_limit=value)
    assert info.value.setting == "proj.limited.lock_limit"
    assert info.value.value == value


@pytest.mark.parametrize("value", [0, -3, 1.5])
def test_a_bad_redlock_limit_setting_names_the_setting(value: Any) -> None:
    """The app-wide setting is named when it supplied the bad value."""
    with pytest.raises(ConfigurationError) as info:
        bound({"redlock_limit": value})
    assert info.value.setting == "redlock_limit"


def test_a_bad_queue_entry_limit_names_the_entry() -> None:
    """A locked queue's limit is checked at worker start, named by its entry."""
    conf = {"redlock_url": "redis://127.0.0.1:6379/0", "redlock_queues": {"reports": {"limit": 0}}}
    with pytest.raises(ConfigurationError) as info:
        check_settings(conf)
    assert info.value.setting == "redlock_queues['reports'].limit"


def test_a_queue_entry_limit_applies_below_the_task_option() -> None:
    """Order as for every option: task attribute > queue entry > setting > default."""

    class Task:
        name = "proj.t"
        lock_limit = None

    assert resolve(Task, {}).limit == 1
    assert resolve(Task, {"redlock_limit": 2}).limit == 2
    assert resolve(Task, {"redlock_limit": 2}, "q", {"limit": 4}).limit == 4
    Task.lock_limit = 3
    assert resolve(Task, {"redlock_limit": 2}, "q", {"limit": 4}).limit == 3


@pytest.mark.parametrize("mode", ["until_executing", "until_executed", "until_and_while_executing"])
def test_a_limit_with_an_enqueue_window_is_refused(mode: str) -> None:
    """Only while_executing takes a limit; the error names the limit and says why."""
    with pytest.raises(ConfigurationError) as info:
        bound({}, lock_limit=3, lock_mode=mode)
    assert info.value.setting == "proj.limited.lock_limit"
    assert "while_executing" in info.value.reason and mode in info.value.reason


def test_a_limit_on_redlock_masters_is_refused() -> None:
    """The semaphore has no quorum version: a limit on a list of masters fails at bind."""
    with pytest.raises(ConfigurationError) as info:
        bound({"redlock_url": REDLOCK_URLS}, lock_limit=3)
    assert info.value.setting == "proj.limited.lock_limit"
    assert "Redlock" in info.value.reason
    with pytest.raises(ConfigurationError) as info:
        check_settings({"redlock_url": REDLOCK_URLS, "redlock_limit": 2})
    assert info.value.setting == "redlock_limit"
    store = LockStore(parse_store({"redlock_url": REDLOCK_URLS}))
    with pytest.raises(ConfigurationError):
        store.lock("k", limit=2, timeout=1)


def test_a_limit_of_one_is_todays_lock() -> None:
    """lock_limit=1 binds like a task without it, on every store."""
    bound({}, lock_limit=1)
    bound({"redlock_url": REDLOCK_URLS}, lock_limit=1)


@pytest.mark.parametrize("value", BAD_LIMITS)
def test_the_core_decorator_and_rq_refuse_a_bad_limit(value: Any) -> None:
    """Semaphore(limit=...), singleton(limit=...) and singleton_job(limit=...) name ``limit``."""

    def job() -> None:
        return None

    for build in (
        lambda: Semaphore(None, "k", limit=value, timeout=1),
        lambda: singleton(job, url="redis://127.0.0.1:1/0", limit=value),
        lambda: singleton_job(job, limit=value),
    ):
        with pytest.raises(ConfigurationError) as info:
            build()
        assert info.value.setting == "limit"


def test_a_semaphore_needs_a_ttl() -> None:
    """A permit without expiry would leak with its holder: timeout is required."""
    with pytest.raises(ConfigurationError) as info:
        Semaphore(None, "k", limit=2, timeout=None)  # type: ignore[arg-type]
    assert info.value.setting == "timeout"


@pytest.mark.parametrize("name", ["plain", "redlock:v1:{proj.task:abc}", "{tag}rest", "a}b"])
def test_a_semaphores_keys_share_one_cluster_slot(name: str) -> None:
    """Permits, fence, wait list and wake list live in one slot: every script runs on one node."""
    keys = semaphore_keys(name, cluster=True)
    if "}" in name and "{" not in name:
        return  # no tag can share such a name's slot; outside Cluster only
    slots = {
        key_slot(key.encode())
        for key in (keys.permits, keys.fence, keys.waiters, keys.waiting, keys.wake)
    }
    assert len(slots) == 1
    assert keys.fence == fence_key_for(name, cluster=True)
    assert semaphore_keys(name).fence == fence_key_for(name)  # outside Cluster: the store's
