"""Pure checks of the lock's argument validation, fence keys and lease arithmetic."""

from __future__ import annotations

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from celery_redlock import ConfigurationError, Lease, Lock, LockNotOwned, fence_key_for
from celery_redlock.core.fences import FENCE_COUNTER
from celery_redlock.core.lease import DRIFT_FLOOR


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def offline_client() -> redis.Redis:
    # Never connected: these tests must fail before any command is sent.
    return redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.01)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"timeout": 0.0001}, "timeout"),
        ({"timeout": "10"}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"sleep": -0.1}, "sleep"),
        ({"blocking_timeout": -1}, "blocking_timeout"),
        ({"auto_renew": True}, "timeout"),
        ({"timeout": 1, "drift_factor": 0.5}, "drift_factor"),
        ({"timeout": 1, "fence_retention": 0}, "fence_retention"),
    ],
)
def test_bad_arguments_raise_configuration_error_naming_them(kwargs, setting):
    """Invalid constructor arguments fail at once with the argument's name and value."""
    with pytest.raises(ConfigurationError) as info:
        Lock(offline_client(), "k", **kwargs)
    assert info.value.setting == setting
    assert setting in str(info.value)


def test_configuration_error_is_a_value_error():
    """Callers that catch ValueError for bad arguments keep working."""
    assert issubclass(ConfigurationError, ValueError)


def test_lock_errors_subclass_redis_py_errors():
    """Code that catches redis-py's lock errors also catches ours."""
    assert issubclass(LockNotOwned, redis.exceptions.LockNotOwnedError)
    assert issubclass(LockNotOwned, redis.exceptions.LockError)


@pytest.mark.parametrize("bad", [0, -5, 0.0001])
def test_extend_rejects_non_positive_time_before_any_command(bad):
    """extend() with a TTL of zero or less raises before talking to Redis."""
    lock = Lock(offline_client(), "k", timeout=5)
    lock.local.token = b"t"  # pretend held: the offline client proves nothing is sent
    with pytest.raises(ConfigurationError):
        lock.extend(bad)


@given(st.text(min_size=1, max_size=40))
def test_fence_key_shares_the_lock_keys_cluster_slot(name):
    """On Cluster the acquire script touches the lock key and its slot's counter: one slot."""
    fence_key = fence_key_for(name, cluster=True)
    assert fence_key != name
    assert key_slot(fence_key.encode()) == key_slot(name.encode())
    assert fence_key_for(name.encode(), cluster=True) == fence_key.encode()


@pytest.mark.parametrize(
    ("name", "counter"),
    [
        ("jobs:{}x}", "jobs:fence"),
        ("{}a}b", FENCE_COUNTER),
        ("a{}{b}", "a:fence"),
        ("plain", FENCE_COUNTER),
        ("{tag}rest", FENCE_COUNTER),
        ("app:v1:{t.job:ab12}", "app:v1:fence"),
        ("app:v1:fence", "app:v1:fence:fence"),
    ],
)
def test_every_name_of_a_prefix_draws_from_one_counter_or_one_per_slot(name, counter):
    """Outside Cluster the names of one prefix share its counter (inside the prefix, for
    ACLs); on Cluster, one per slot, even for names whose empty first tag makes Redis
    hash the whole key. A counter is never the lock's own key."""
    assert fence_key_for(name) == counter
    assert key_slot(fence_key_for(name, cluster=True).encode()) == key_slot(name.encode())


def test_lease_validity_deducts_elapsed_time_and_drift():
    """Validity is ttl minus the time since the request was sent minus the drift allowance."""
    clock = FakeClock()
    sent_at = clock.now
    clock.now += 0.5
    lease = Lease(
        client=None,
        name="k",
        token=b"t",
        fence=1,
        ttl=10.0,
        sent_at=sent_at,
        clock=clock,
        drift_factor=0.01,
    )
    assert lease.remaining() == pytest.approx(10.0 - 0.5 - (0.1 + DRIFT_FLOOR))
    clock.now += 20
    assert lease.remaining() == 0.0
    assert not lease.valid


def test_lease_without_ttl_never_runs_out():
    """A lock without a timeout has unbounded validity until released."""
    clock = FakeClock()
    lease = Lease(client=None, name="k", token=b"t", fence=1, ttl=None, sent_at=0, clock=clock)
    clock.now += 1e9
    assert lease.remaining() == float("inf")
    lease.released = True
    assert lease.remaining() == 0.0


def test_mark_lost_survives_a_failing_callback_and_fires_once(caplog):
    """A raising on_lost callback is logged, not propagated, and runs only once."""
    calls = []

    def callback(lease: Lease) -> None:
        calls.append(lease)
        raise RuntimeError("boom")

    lease = Lease(
        client=None,
        name="k",
        token=b"t",
        fence=7,
        ttl=1.0,
        sent_at=0,
        clock=FakeClock(),
        on_lost=callback,
    )
    lease.mark_lost("test")
    lease.mark_lost("again")
    assert lease.lost and lease.loss_reason == "test"
    assert len(calls) == 1
    assert "lock k (fence 7) lost: test" in caplog.text
    assert "on_lost callback of lock k (fence 7) failed" in caplog.text
