"""Replicated acquisition's settings and arguments: defaults, and errors naming what is wrong."""

from __future__ import annotations

import pytest
import redis

from celery_redlock import ConfigurationError, Lock, ReplicationError
from celery_redlock.celery.settings import check_settings
from celery_redlock.core.replication import DEFAULT_REPLICA_TIMEOUT, Replication
from celery_redlock.core.store import LockStore, parse_store

SENTINEL = {
    "redlock_url": "sentinel://s1:26379",
    "redlock_transport_options": {"master_name": "locks"},
}


@pytest.mark.parametrize("bad", [-1, 1.5, "1", "AUTO", True, None, [1]])
def test_bad_min_replicas_setting_names_it(bad):
    """Negative, non-integer and misspelt values stop the worker naming redlock_min_replicas."""
    with pytest.raises(ConfigurationError) as info:
        check_settings({**SENTINEL, "redlock_min_replicas": bad})
    assert info.value.setting == "redlock_min_replicas"
    assert "whole number >= 0 or 'auto'" in str(info.value)


@pytest.mark.parametrize("bad", [0, -1, 0.0001, "1", float("inf"), True])
def test_bad_replica_timeout_setting_names_it(bad):
    """The wait for the replicas must be a number of seconds, at least a millisecond."""
    with pytest.raises(ConfigurationError) as info:
        check_settings({**SENTINEL, "redlock_replica_timeout": bad})
    assert info.value.setting == "redlock_replica_timeout"


def test_settings_default_to_auto_and_the_locks_own_timeout():
    """Unset, the store asks its topology (auto) and each lock picks its own wait."""
    spec = parse_store(SENTINEL)
    assert spec.min_replicas == "auto" and spec.replica_timeout is None
    spec = parse_store({**SENTINEL, "redlock_min_replicas": 2, "redlock_replica_timeout": 0.2})
    assert spec.min_replicas == 2 and spec.replica_timeout == 0.2


def test_redlock_store_refuses_a_number_of_replicas():
    """Redlock's masters are independent: a replica count there is a configuration error."""
    masters = ["redis://a:1/0", "redis://b:1/0", "redis://c:1/0"]
    assert parse_store({"redlock_url": masters, "redlock_min_replicas": "auto"}).min_replicas
    with pytest.raises(ConfigurationError) as info:
        parse_store({"redlock_url": masters, "redlock_min_replicas": 1})
    assert info.value.setting == "redlock_min_replicas"


def test_auto_is_zero_on_one_redis_without_asking_it():
    """A plain Redis URL has nothing that promotes a replica: auto is 0, with no I/O."""
    store = LockStore(parse_store({"redlock_url": "redis://127.0.0.1:1/0"}))
    assert store.min_replicas() == 0
    assert store.lock("k", timeout=1).replication is None
    store.close()


def test_an_explicit_count_reaches_the_stores_locks():
    """redlock_min_replicas and redlock_replica_timeout become every lock's arguments."""
    conf = {
        "redlock_url": "redis://127.0.0.1:1/0",
        "redlock_min_replicas": 2,
        "redlock_replica_timeout": 0.25,
    }
    store = LockStore(parse_store(conf))
    assert store.lock("k", timeout=5).replication == Replication(2, 0.25)
    store.close()


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"min_replicas": -1}, "min_replicas"),
        ({"min_replicas": 1.0}, "min_replicas"),
        ({"min_replicas": "auto"}, "min_replicas"),
        ({"min_replicas": 1, "replica_timeout": 0}, "replica_timeout"),
        ({"min_replicas": 1, "replica_timeout": 5}, "replica_timeout"),
    ],
)
def test_bad_lock_arguments_name_them(kwargs, setting):
    """Lock(min_replicas=..., replica_timeout=...) reports the argument at fault."""
    with pytest.raises(ConfigurationError) as info:
        Lock(redis.Redis(), "k", timeout=5, **kwargs)
    assert info.value.setting == setting


def test_lock_argument_defaults():
    """0 replicas sends no WAIT; with replicas the wait is 0.5 s, or a tenth of a shorter TTL."""
    client = redis.Redis()
    assert Lock(client, "k", timeout=5).replication is None
    assert Lock(client, "k", timeout=10, min_replicas=1).replication == Replication(
        1, DEFAULT_REPLICA_TIMEOUT
    )
    assert Lock(client, "k", timeout=1, min_replicas=2).replication == Replication(2, 0.1)
    assert Lock(client, "k", min_replicas=1).replication == Replication(1, 0.5)


def test_replication_error_is_a_redis_error():
    """Tasks meet an unconfirmed lock as a lock store failure (lock_on_redis_error)."""
    error = ReplicationError("x", lock_name="k", acknowledged=0, needed=1)
    assert isinstance(error, redis.exceptions.RedisError)
    assert not isinstance(error, redis.exceptions.ResponseError)
    assert repr(error) == "ReplicationError('x')"


def test_wait_never_waits_forever():
    """WAIT 0 ms blocks until the replicas answer: the timeout sent is at least 1 ms."""
    assert Replication(1, 0.0004).wait == ("WAIT", 1, 1)
    assert Replication(2, 0.25).wait == ("WAIT", 2, 250)
