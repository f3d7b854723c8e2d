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


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("nonsense://", "must specify one of the following schemes"),
        ("nonsense://x", "must specify one of the following schemes"),
        ("redis://127.0.0.1:port/0", "Port could not be cast"),
    ],
)
def test_a_url_redis_py_cannot_read_fails_at_decoration(url, reason):
    """singleton(url=...) reads the URL as redis-py will; one it cannot read is refused at once."""
    with pytest.raises(ConfigurationError, match=reason) as info:
        singleton(url=url)(plain)
    assert info.value.setting == "url"
    assert str(info.value).startswith(f"url={url!r}: ")


def test_a_rejected_url_does_not_show_its_password():
    """The error names the URL with its password masked."""
    with pytest.raises(ConfigurationError) as info:
        singleton(plain, url="nonsense://user:s3cret@host/0")
    assert "s3cret" not in str(info.value)
    assert "user:***@host" in str(info.value)


def test_every_url_redis_py_reads_is_accepted():
    """TLS, unix sockets, credentials and query options pass as redis-py reads them."""
    for url in (
        "redis://127.0.0.1:1/0",
        "rediss://user:pw@127.0.0.1:1/2",
        "unix:///tmp/redis.sock?db=3",
        "redis://127.0.0.1:1/0?socket_timeout=0.5",
    ):
        singleton(plain, url=url)


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
