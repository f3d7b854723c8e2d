"""Reading the lock store setting: topologies, their URL syntax, and the errors for bad ones."""

from __future__ import annotations

import pytest

from celery_redlock import ConfigurationError
from celery_redlock.celery.settings import check_settings, lock_url
from celery_redlock.core.store import LockStore, StoreSpec, parse_store

SENTINELS = "sentinel://:pw@s1:26379/3;sentinel://s2:26380;sentinel://s3"


@pytest.mark.parametrize(
    ("conf", "topology", "urls"),
    [
        ({"redlock_url": "redis://h:1/2"}, "redis", ("redis://h:1/2",)),
        ({"redlock_url": ["redis://h:1/2"]}, "redis", ("redis://h:1/2",)),
        (
            {"redlock_url": ["redis://a:1", "redis://b:1", "unix:///tmp/c.sock"]},
            "redlock",
            ("redis://a:1", "redis://b:1", "unix:///tmp/c.sock"),
        ),
        (
            {"redlock_url": "redis+cluster://a:7000; redis+cluster://b:7001"},
            "cluster",
            ("redis+cluster://a:7000", "redis+cluster://b:7001"),
        ),
        (
            {"redlock_url": "rediss+cluster://u:p@a:7000/0"},
            "cluster",
            ("rediss+cluster://u:p@a:7000/0",),
        ),
        (
            {"redlock_url": SENTINELS, "redlock_transport_options": {"master_name": "locks"}},
            "sentinel",
            tuple(SENTINELS.split(";")),
        ),
        (
            {"broker_url": SENTINELS, "broker_transport_options": {"master_name": "mq"}},
            "sentinel",
            tuple(SENTINELS.split(";")),
        ),
        ({"broker_url": "redis://b/0;redis://c/0"}, "redis", ("redis://b/0",)),
        ({"broker_url": "redis+socket:///tmp/r.sock"}, "redis", ("unix:///tmp/r.sock",)),
        (
            {"broker_url": "socket:///tmp/r.sock?virtual_host=2"},
            "redis",
            ("unix:///tmp/r.sock?db=2",),
        ),
        ({"redlock_url": "redis+socket:///tmp/r.sock"}, "redis", ("unix:///tmp/r.sock",)),
        (
            {"redlock_url": ["socket:///tmp/a.sock", "redis://b:1"]},
            "redlock",
            ("unix:///tmp/a.sock", "redis://b:1"),
        ),
    ],
)
def test_each_topology_is_read_from_its_syntax(conf, topology, urls):
    """A URL, a list (Redlock), redis+cluster:// and sentinel:// each pick their topology."""
    spec = parse_store(conf)
    assert (spec.topology, spec.urls) == (topology, urls)


def test_sentinel_options_follow_kombus_transport_options():
    """master_name, min_other_sentinels and sentinel_kwargs are read as kombu names them."""
    spec = parse_store(
        {
            "redlock_url": SENTINELS,
            "redlock_transport_options": {
                "master_name": "locks",
                "min_other_sentinels": 1,
                "sentinel_kwargs": {"password": "s"},
                "visibility_timeout": 10,  # a broker option: not ours, ignored
            },
        }
    )
    assert dict(spec.options) == {
        "master_name": "locks",
        "min_other_sentinels": 1,
        "sentinel_kwargs": {"password": "s"},
    }
    assert spec.describe() == (
        "sentinel master 'locks' via sentinel://:***@s1:26379/3, sentinel://s2:26380, sentinel://s3"
    )


@pytest.mark.parametrize(
    ("conf", "setting", "message"),
    [
        ({"redlock_url": 6379}, "redlock_url", "must be a redis://"),
        ({"redlock_url": "http://x"}, "redlock_url", "must be a redis://"),
        ({"redlock_url": "redis://a;redis://b"}, "redlock_url", "give a Python list"),
        ({"redlock_url": "redis+cluster://a;sentinel://b"}, "redlock_url", "must be a redis://"),
        ({"redlock_url": "redis://h:port/0"}, "redlock_url", "Port could not be cast"),
        ({"redlock_url": "redis://h:1/x"}, "redlock_url", "bad database"),
        ({"redlock_url": []}, "redlock_url", "empty list"),
        ({"redlock_url": ["redis://a", "http://b"]}, "redlock_url[1]", "independent servers"),
        (
            {"redlock_url": ["redis://a", "sentinel://b"]},
            "redlock_url[1]",
            "not Cluster or Sentinel",
        ),
        (
            {"redlock_url": ["redis://a:6379/0", "redis://b", "redis://a/1"]},
            "redlock_url[2]",
            r"same server as redlock_url\[0\]",
        ),
        ({"redlock_url": "redis+cluster://a:7000/1"}, "redlock_url", "only database 0"),
        ({"redlock_url": "redis+cluster:///x"}, "redlock_url", "names no host"),
        ({"redlock_url": "sentinel://s1"}, "redlock_transport_options", "master_name"),
        (
            {"redlock_url": "sentinel://s1", "redlock_transport_options": "locks"},
            "redlock_transport_options",
            "must be a mapping",
        ),
        (
            {
                "redlock_url": "sentinel://s1",
                "redlock_transport_options": {"master_name": "m", "min_other_sentinels": -1},
            },
            "redlock_transport_options['min_other_sentinels']",
            "whole number",
        ),
        ({"broker_url": "sentinel://s1"}, "broker_transport_options", "master_name"),
        ({"redlock_url": "redis+socket://"}, "redlock_url", "names no socket path"),
        ({"broker_url": "socket://"}, "broker_url", "names no socket path"),
        ({"broker_url": "socket:/tmp/r.sock"}, "redlock_url", "not a Redis URL"),
        ({"broker_url": "redis+sock:///tmp/r.sock"}, "redlock_url", "not a Redis URL"),
        (
            {"redlock_url": ["socket:///tmp/a.sock", "unix:///tmp/a.sock?db=1"]},
            "redlock_url[1]",
            r"same server as redlock_url\[0\]",
        ),
    ],
)
def test_bad_settings_name_the_setting(conf, setting, message):
    """Every malformed store setting is a ConfigurationError naming the setting at fault."""
    with pytest.raises(ConfigurationError, match=message) as info:
        parse_store(conf)
    assert info.value.setting == setting


def test_passwords_never_reach_the_error():
    """A rejected URL is quoted with its password masked."""
    with pytest.raises(ConfigurationError) as info:
        parse_store({"redlock_url": ["redis://:hunter2@a:1", "redis://:hunter2@a:1/3"]})
    assert "hunter2" not in str(info.value)


def test_settings_check_accepts_the_options_setting_and_describes_the_store():
    """redlock_transport_options is a known setting, and lock_url describes the topology."""
    conf = {"redlock_url": SENTINELS, "redlock_transport_options": {"master_name": "locks"}}
    check_settings(conf)
    assert lock_url(conf).startswith("sentinel master 'locks' via")
    assert lock_url({"redlock_url": ["redis://a", "redis://b", "redis://c"]}) == (
        "Redlock over 3 masters (redis://a, redis://b, redis://c)"
    )


def test_a_store_builds_no_client_until_used():
    """Making a store does no I/O, so workers start while a Cluster is down."""
    store = LockStore(StoreSpec("cluster", ("redis+cluster://127.0.0.1:1",)))
    assert "Redis Cluster" in repr(store)
    store.close()  # nothing to close yet
