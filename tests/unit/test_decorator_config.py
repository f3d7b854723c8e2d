"""singleton() rejects bad options when the function is decorated, naming the option."""

from __future__ import annotations

import pytest

from celery_redlock import ConfigurationError, singleton


def plain(a, b=1):
    return a + b


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ({"ttl": 0}, "ttl"),
        ({"ttl": "10"}, "ttl"),
        ({"on_conflict": "requeue"}, "on_conflict"),
        ({"on_redis_error": "requeue"}, "on_redis_error"),
        ({"wait_timeout": -1}, "wait_timeout"),
        ({"wait_sleep": True}, "wait_sleep"),
        ({"key": 3}, "key"),
        ({"key_prefix": "a{b}"}, "key_prefix"),
        ({"name": "x{y}"}, "name"),
        ({"url": "localhost:6379"}, "url"),
    ],
)
def test_bad_option_is_named(options, setting):
    """Each invalid option raises ConfigurationError naming that option."""
    kwargs = {"url": "redis://127.0.0.1:1/0", **options}
    with pytest.raises(ConfigurationError) as info:
        singleton(plain, **kwargs)
    assert info.value.setting == setting


def test_client_or_url_is_required_exactly_once():
    """Neither or both of client= and url= is a ConfigurationError."""
    with pytest.raises(ConfigurationError, match="exactly one"):
        singleton(plain)
    with pytest.raises(ConfigurationError, match="exactly one"):
        singleton(plain, client=object(), url="redis://127.0.0.1:1/0")


def test_key_names_must_be_arguments():
    """A key naming an argument the function does not take fails at decoration."""
    with pytest.raises(ConfigurationError, match="does not take"):
        singleton(plain, url="redis://127.0.0.1:1/0", key=["c"])


def test_keys_bind_arguments_like_a_task():
    """Positional and keyword spellings and defaults give one key; key= narrows it."""
    locked = singleton(plain, url="redis://127.0.0.1:1/0", key_prefix="p")
    assert locked.lock_key_for(1) == locked.lock_key_for(a=1, b=1) == locked.lock_key_for(1, 1)
    assert locked.lock_key_for(1) != locked.lock_key_for(2)
    assert locked.lock_key_for(1).startswith("p:v1:{tests.unit.test_decorator_config.plain:")
    by_a = singleton(plain, url="redis://127.0.0.1:1/0", key=["a"])
    assert by_a.lock_key_for(1, 2) == by_a.lock_key_for(1, 3)


def test_decorator_keeps_the_function_name_and_can_take_options_first():
    """@singleton(...) and singleton(func, ...) both give a wrapper named like the function."""

    @singleton(url="redis://127.0.0.1:1/0", name="custom")
    async def handler(x):
        return x

    assert handler.__name__ == "handler"
    assert ":v1:{custom:" in handler.lock_key_for(1)
