"""Task options given in @app.task(...) work as documented: callables stay callables, typos fail."""

from __future__ import annotations

import threading
import uuid

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redlock import SKIPPED, ConfigurationError, SingletonTask
from celery_redlock.celery.settings import resolve


def new_app(redis_url: str) -> Celery:
    app = Celery(f"options-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        result_backend=redis_url,
        task_default_queue=f"q-{uuid.uuid4().hex[:8]}",
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=False,
        redlock_url=redis_url,
    )
    return app


def test_a_callable_lock_key_given_in_the_decorator_is_called_with_args_and_kwargs(redis_server):
    app = new_app(redis_server.url)
    started, finish = threading.Event(), threading.Event()

    @app.task(
        base=SingletonTask,
        name="opts.per_account",
        lock_key=lambda args, kwargs: f"account:{args[0]}",
    )
    def per_account(account, amount):
        started.set()
        finish.wait(10)
        return amount

    # Celery makes decorator keywords class attributes: a plain function would
    # become a method taking the task as a third argument.
    assert per_account.lock_key_for(7, 1) == per_account.lock_key_for(7, 2)
    assert per_account.lock_key_for(7, 1) != per_account.lock_key_for(8, 1)
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        first = per_account.delay(7, 1)
        assert started.wait(10)
        second = per_account.delay(7, 2)  # same account, other amount: a duplicate
        while second.state not in (SKIPPED, "SUCCESS", "FAILURE"):
            threading.Event().wait(0.05)
        assert second.state == SKIPPED
        finish.set()
        assert first.get(timeout=10) == 1


@pytest.mark.parametrize(
    ("misspelt", "closest"),
    [("lock_tll", "lock_ttl"), ("lock_on_conflcit", "lock_on_conflict"), ("lock_xyzzy", None)],
)
def test_a_misspelt_lock_option_fails_when_the_task_is_bound(misspelt, closest):
    app = Celery(f"typo-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.redlock_url = "redis://127.0.0.1:6379/0"

    @app.task(base=SingletonTask, name="opts.typo", **{misspelt: 5})
    def typo():
        return 1

    with pytest.raises(ConfigurationError) as error:
        app.finalize()
    assert error.value.setting == f"opts.typo.{misspelt}"
    message = str(error.value)
    assert "is not a lock option of SingletonTask" in message
    if closest:
        assert f"did you mean {closest}?" in message
    else:
        assert "did you mean" not in message


@pytest.mark.parametrize("unprefixed", ["ttl", "on_conflict", "key"])
def test_a_lock_option_given_without_its_prefix_is_pointed_out(unprefixed, caplog):
    """``ttl=30`` sets an attribute no lock reads: a warning names ``lock_ttl``."""
    app = Celery(f"prefix-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.redlock_url = "redis://127.0.0.1:6379/0"

    @app.task(base=SingletonTask, name="opts.unprefixed", lock_ttl=20, **{unprefixed: 30})
    def unprefixed_task():
        return 1

    with caplog.at_level("WARNING", logger="celery_redlock.celery.task"):
        app.finalize()
    warnings = [r.getMessage() for r in caplog.records if r.name == "celery_redlock.celery.task"]
    assert warnings == [
        f"celery-redlock: task opts.unprefixed has an attribute {unprefixed!r}, which no lock "
        f"reads: lock options take the prefix (did you mean lock_{unprefixed}?)"
    ]


def test_a_task_with_only_prefixed_options_gets_no_warning(caplog):
    app = Celery(f"prefix-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.redlock_url = "redis://127.0.0.1:6379/0"

    @app.task(base=SingletonTask, name="opts.prefixed", lock_ttl=20, lock_key=["a"])
    def prefixed(a):
        return a

    with caplog.at_level("WARNING", logger="celery_redlock.celery.task"):
        app.finalize()
    assert [r for r in caplog.records if r.name == "celery_redlock.celery.task"] == []


class _DjangoSettings:
    """Settings as a Django project holds them, read with ``namespace="CELERY"``."""

    CELERY_BROKER_URL = "memory://"
    CELERY_REDLOCK_URL = "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize(
    ("misspelt", "closest"),
    [
        ("CELERY_REDLOCK_TLL", "CELERY_REDLOCK_TTL"),
        ("CELERY_redlock_ttl", "CELERY_REDLOCK_TTL"),  # Celery reads only the upper case
    ],
)
def test_a_misspelt_namespaced_setting_fails_when_the_task_is_bound(misspelt, closest):
    """Under namespace="CELERY" a misspelt CELERY_REDLOCK_* setting is an error, not ignored."""
    settings = type("Settings", (_DjangoSettings,), {misspelt: 30})
    app = Celery(f"django-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")

    @app.task(base=SingletonTask, name="opts.django")
    def django_task():
        return 1

    with pytest.raises(ConfigurationError) as error:
        app.finalize()
    assert error.value.setting == misspelt
    assert str(error.value).endswith(f"is not a setting; did you mean {closest}?")


def test_a_namespaced_setting_spelt_right_is_read():
    """CELERY_REDLOCK_TTL reaches the task's options; nothing is refused."""
    settings = type("Settings", (_DjangoSettings,), {"CELERY_REDLOCK_TTL": 30})
    app = Celery(f"django-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")

    @app.task(base=SingletonTask, name="opts.django")
    def django_task():
        return 1

    app.finalize()
    assert resolve(django_task, app.conf).ttl == 30
