"""Redlock logic without servers: arguments, quorum arithmetic, errors and watchdog hand-off."""

from __future__ import annotations

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from celery_redlock import (
    ConfigurationError,
    Lease,
    LockError,
    LockNotAcquired,
    LockNotOwned,
    QuorumNotAchieved,
    Redlock,
    Watchdog,
)
from celery_redlock.core.quorum import Votes, default_node_timeout

OFFLINE = ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"]


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("masters", "kwargs", "setting"),
    [
        ([], {"timeout": 1}, "masters"),
        ("redis://127.0.0.1:1/0", {"timeout": 1}, "masters"),
        ([OFFLINE[0], OFFLINE[0]], {"timeout": 1}, "masters"),
        (OFFLINE, {"timeout": 1, "node_timeout": 1}, "node_timeout"),
        (OFFLINE, {"timeout": 1, "node_timeout": 0}, "node_timeout"),
        (OFFLINE, {"timeout": 1, "node_timeout": "0.1"}, "node_timeout"),
        (OFFLINE, {"timeout": 0}, "timeout"),
        (OFFLINE, {"auto_renew": True}, "timeout"),
        (OFFLINE, {"timeout": 1, "drift_factor": 0.6}, "drift_factor"),
    ],
)
def test_bad_arguments_raise_configuration_error_naming_them(masters, kwargs, setting):
    """Invalid arguments fail at construction, naming the argument, before any command."""
    with pytest.raises(ConfigurationError) as info:
        Redlock(masters, "k", **kwargs)
    assert info.value.setting == setting


def test_the_same_server_twice_is_refused_whatever_the_spelling():
    """A client and a URL for one server would give it two votes."""
    client = redis.Redis(host="127.0.0.1", port=1)
    with pytest.raises(ConfigurationError):
        Redlock([client, "redis://127.0.0.1:1/0", OFFLINE[1]], "k", timeout=1)


@pytest.mark.parametrize(
    ("first", "second", "server"),
    [
        ("redis://127.0.0.1:1/0", "redis://127.0.0.1:1/1", "127.0.0.1:1"),
        ("unix:///tmp/r.sock?db=0", "unix:///tmp/r.sock?db=3", "unix:///tmp/r.sock"),
    ],
)
def test_two_databases_of_one_server_are_refused_naming_it(first, second, server):
    """Two databases of one server are one master: refused, naming the server."""
    with pytest.raises(ConfigurationError) as info:
        Redlock([first, second, OFFLINE[1]], "k", timeout=1)
    assert info.value.setting == "masters"
    assert server in str(info.value)


@pytest.mark.parametrize(
    ("ttl", "expected"),
    [(None, 1.0), (100, 1.0), (10, 1.0), (1, 0.1), (0.3, 0.05), (0.06, 0.03)],
)
def test_default_node_timeout_is_a_tenth_of_the_ttl_within_bounds(ttl, expected):
    """The node timeout defaults to ttl/10 within 50 ms..1 s, and never above half the TTL."""
    assert default_node_timeout(ttl) == pytest.approx(expected)


def test_quorum_and_names():
    """The quorum is a strict majority, and masters are named by address."""
    lock = Redlock([*OFFLINE, "redis://127.0.0.1:4/2"], "k", timeout=1)
    assert lock.quorum == 3
    assert lock.nodes[-1] == "127.0.0.1:4/2"
    assert lock.node_timeout == pytest.approx(0.1)
    assert not lock.owned()  # no token: False without sending anything


@given(size=st.integers(1, 9), votes=st.lists(st.sampled_from([True, False, None]), max_size=9))
def test_votes_decide_exactly_when_the_outcome_is_certain(size, votes):
    """The count stops once a majority agreed or can no longer agree, never before."""
    votes = votes[:size]
    tally = Votes(size)
    settle = tally.settle(lambda i, agreed: agreed)
    decided_at = None
    for i, vote in enumerate(votes):
        outcome = ConnectionError("down") if vote is None else vote
        if settle(i, outcome) and decided_at is None:
            decided_at = i
    yes = votes.count(True)
    majority = size // 2 + 1
    assert tally.won == (yes >= majority)
    certain = yes >= majority or (len(votes) - yes) > size - majority
    assert (decided_at is not None) == certain
    assert tally.refused_by_majority == (votes.count(False) > size - majority)


def test_retry_delay_is_jittered_around_sleep():
    """Blocking retries wait a random time around ``sleep`` so contenders stop colliding."""
    lock = Redlock(OFFLINE, "k", timeout=1)
    delays = {lock._retry_delay(0.1) for _ in range(50)}
    assert all(0.05 <= d <= 0.15 for d in delays)
    assert len(delays) > 40


def test_quorum_not_achieved_is_a_lock_error_with_its_evidence():
    """The error is caught as a lock error and shows each master's reason."""
    errors = {"a:1/0": redis.ConnectionError("refused"), "b:1/0": LockNotAcquired("held")}
    error = QuorumNotAchieved("not acquired", "k", errors=errors, granted=1, needed=2)
    assert isinstance(error, LockError)
    assert isinstance(error, redis.exceptions.LockError)
    assert not isinstance(error, LockNotAcquired)
    assert error.errors == errors and error.granted == 1 and error.needed == 2
    assert "not acquired" in repr(error)


def test_tokens_are_encoded_as_utf8():
    """Caller tokens are stored as UTF-8 bytes, as redis-py would send them."""
    lock = Redlock(OFFLINE, "k", timeout=1)
    assert lock._encode_token("héllo") == "héllo".encode()
    assert lock._encode_token(b"raw") == b"raw"


def test_a_single_server_lease_does_not_renew_itself():
    """Plain leases are renewed in batches; only spanning leases implement renew()."""
    clock = FakeClock()
    lease = Lease(client=None, name="k", token=b"t", fence=1, ttl=1, sent_at=clock(), clock=clock)
    assert not lease.renews_itself
    with pytest.raises(NotImplementedError):
        lease.renew()


class SelfRenewing(Lease):
    """A lease renewed through its own renew(), answering as told."""

    renews_itself = True
    __slots__ = ("answers", "calls")

    def __init__(self, clock, answers):
        super().__init__(client=None, name="k", token=b"t", fence=1, ttl=3.0,
                         sent_at=clock(), clock=clock)  # fmt: skip
        self.answers = answers
        self.calls = 0

    def renew(self):
        self.calls += 1
        answer = self.answers.pop(0) if self.answers else None
        if isinstance(answer, LockNotOwned):
            self.mark_lost("not owned")
        if isinstance(answer, Exception):
            raise answer
        self.validate_until(self._clock(), self.ttl)


class _NeverStarted:
    def is_alive(self) -> bool:
        return True


@pytest.fixture
def watchdog_and_clock():
    clock = FakeClock()
    dog = Watchdog(clock=clock)
    dog._thread = _NeverStarted()  # drive passes by hand with renew_due()
    return dog, clock


def test_watchdog_renews_a_spanning_lease_through_its_hook(watchdog_and_clock):
    """A lease that renews itself is renewed at a third of its TTL, by its own renew()."""
    dog, clock = watchdog_and_clock
    lease = SelfRenewing(clock, [])
    dog.watch(lease)
    clock.now += 0.4
    dog.renew_due()
    assert lease.calls == 0
    for _ in range(3):
        clock.now += 1.0
        dog.renew_due()
    assert lease.calls == 3 and lease.renewals == 3 and not lease.lost


def test_watchdog_retries_a_lost_quorum_until_the_validity_runs_out(watchdog_and_clock):
    """Renewals short of a majority are retried, and the lease is lost at its deadline."""
    dog, clock = watchdog_and_clock
    lease = SelfRenewing(clock, [QuorumNotAchieved("short", "k")] * 100)
    dog.watch(lease)
    deadline = lease.deadline
    while not lease.lost and clock.now < 120:
        clock.now += 0.1
        dog.renew_due()
    assert lease.lost and "validity" in lease.loss_reason
    assert lease.calls >= 5
    assert clock.now >= deadline


def test_watchdog_drops_a_spanning_lease_found_not_owned(watchdog_and_clock):
    """A lease whose renew() found it not owned is lost at once and never renewed again."""
    dog, clock = watchdog_and_clock
    lease = SelfRenewing(clock, [LockNotOwned("gone", "k")])
    dog.watch(lease)
    clock.now += 1.0
    dog.renew_due()
    assert lease.lost and lease.loss_reason == "not owned"
    clock.now += 5.0
    dog.renew_due()
    assert lease.calls == 1
    assert dog.watched() == 0


@pytest.mark.parametrize(
    ("command", "slot", "script"),
    [
        (("EVALSHA", "ab" * 20, 2, "k", "{k}:fence", b"", 10000, 3600000), 5, "acquire"),
        (("EVAL", "return 1", 1, b"k\xff", b""), 4, None),
        (("SET", "kéy", b"", "NX", "PX", 1500), 2, None),
        (("SET", "k", b"", "NX"), 2, None),
    ],
)
@pytest.mark.parametrize("token", [b"0123456789abcdef" * 2, b"", b"t\r\n\x00" * 40])
def test_a_template_packs_exactly_what_redis_py_packs(command, slot, script, token):
    """Pre-packed acquire/release bytes equal redis-py's packing of the same command,
    by SHA and with the script's source alike."""
    from celery_redlock.core.nodes import Node
    from celery_redlock.core.scripts import ACQUIRE
    from celery_redlock.core.wire import Template

    conn = redis.Connection()
    node = Node("n", 1.0, connection_class=redis.Connection, kwargs={})
    template = Template(command, slot, ACQUIRE if script else None)
    request = template.request(token)
    full = (*command[:slot], token, *command[slot + 1 :])
    assert request.command == full
    packed = b"".join(request.packed(conn, node))
    if script:
        assert packed == b"".join(conn.pack_command(*request.with_source()))
        node.scripts.add(ACQUIRE.sha)
        packed = b"".join(template.request(token).packed(conn, node))
    assert packed == b"".join(conn.pack_command(*full))
