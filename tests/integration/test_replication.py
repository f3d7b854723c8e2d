"""Replicated acquisition on one master with one replica (no Sentinel): WAIT, give-back, fences.

The replica is frozen with SIGSTOP to make acknowledgements miss: it then
neither applies nor acknowledges anything until it is resumed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_redlock import ConfigurationError, Lock, ReplicationError
from celery_redlock.celery.bootsteps import check_lock_store
from celery_redlock.core.lock import fence_key_for
from celery_redlock.core.renewal import Watchdog
from celery_redlock.core.store import store_for
from tests.redis_servers import LOOPBACK, RedisServer
from tests.redis_topologies import wait_replicas_online, wait_until

REPLICATION_LOG = "celery_redlock.core.replication"
#: Wait of a lock whose replica is healthy: WAIT returns at the acknowledgement,
#: so this only keeps a replica starved of CPU on a busy machine from failing a test.
HEALTHY = 3.0


@pytest.fixture
def pair(redis_server_binary, tmp_path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and its replica, linked and in sync."""
    options = ("--repl-diskless-sync-delay", "0")
    with RedisServer(redis_server_binary, workdir=tmp_path / "m", extra_args=options) as master:
        args = (*options, "--replicaof", LOOPBACK, str(master.port))
        with RedisServer(redis_server_binary, workdir=tmp_path / "r", extra_args=args) as replica:
            wait_replicas_online(master, 1)
            yield master, replica


def sent_by_clients(server: RedisServer) -> dict[str, int]:
    """Commands counted by the server, without those the scripts ran and the replica's own."""
    inside_scripts = {"get", "set", "del", "incr", "time", "pexpire", "pttl", "replconf"}
    return {k: v for k, v in server.commandstats().items() if k not in inside_scripts}


def test_a_granted_lock_is_on_the_replica_when_acquire_returns(pair):
    """The acquire script and WAIT go out together: one EVALSHA and one WAIT, no other command."""
    master, replica = pair
    client = master.client()
    Lock(
        client, "warm", timeout=10, min_replicas=1, replica_timeout=HEALTHY
    ).acquire()  # connection handshake
    master.reset_stats()
    lock = Lock(client, "job", timeout=10, min_replicas=1, replica_timeout=HEALTHY)
    assert lock.acquire(blocking=False)
    assert replica.client().get("job") == lock.token  # no waiting: it is there already
    assert sent_by_clients(master) == {"evalsha": 1, "wait": 1}
    lock.release()


def test_without_replicas_the_fast_path_sends_no_wait(pair):
    """min_replicas=0 (the Lock default) is the plain path: one EVALSHA, consecutive fences."""
    master, _ = pair
    client = master.client()
    warm = Lock(client, "warm", timeout=10)
    warm.acquire()
    warm.release()  # both scripts cached, the connection open
    master.reset_stats()
    lock = Lock(client, "job", timeout=10)
    fences = []
    for _ in range(3):
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
    assert sent_by_clients(master) == {"evalsha": 6}
    assert fences == list(range(fences[0], fences[0] + 3))


def test_too_few_acknowledgements_give_the_lock_back(pair, caplog):
    """A frozen replica: the grant is deleted again, the call raises, one WARNING names it."""
    master, replica = pair
    client = master.client()
    caplog.set_level(logging.INFO, logger=REPLICATION_LOG)
    replica.pause()
    try:
        for _ in range(3):
            lock = Lock(client, "job", timeout=10, min_replicas=1, replica_timeout=0.1)
            with pytest.raises(ReplicationError) as info:
                lock.acquire(blocking=False)
            assert client.get("job") is None  # given back on the master
            assert lock.token is None and lock.fence is None
        assert (info.value.event, info.value.acknowledged, info.value.needed) == ("replicas", 0, 1)
        assert info.value.lock_name == "job"
    finally:
        replica.resume()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    expected = "only 0 of 1 replica(s) acknowledged the acquisition of lock job"
    assert expected in warnings[0].getMessage()
    # The replica catches up: the next acquisition counts, and the end of the event is logged.
    lock = Lock(client, "job", timeout=10, min_replicas=1, replica_timeout=HEALTHY)
    assert lock.acquire(blocking=False)
    assert "acknowledged by 1 of 1 replica(s) again" in caplog.records[-1].getMessage()
    lock.release()


def test_contention_is_reported_as_contention_whatever_the_replicas_say(pair):
    """A held lock answers "held" with its holder, even while the replica is away."""
    master, replica = pair
    client = master.client()
    holder = Lock(client, "job", timeout=10, min_replicas=1, replica_timeout=HEALTHY)
    assert holder.acquire(blocking=False)
    replica.pause()
    try:
        other = Lock(client, "job", timeout=10, min_replicas=1, replica_timeout=0.1)
        assert not other.acquire(blocking=False)
        assert other.local.holder[0] == holder.token.decode()
    finally:
        replica.resume()
    holder.release()


def test_renewals_need_the_replicas_too(pair):
    """An extend the replica did not acknowledge raises; a watched lease is lost in time."""
    master, replica = pair
    client = master.client()
    # A replica that is up acknowledges at once, but on a busy machine not
    # always within 0.1 s: give the acquire room; the paused replica below
    # never acknowledges, whatever the timeout.
    lock = Lock(client, "job", timeout=10, min_replicas=1, replica_timeout=2.0)
    assert lock.acquire(blocking=False)
    watchdog = Watchdog()
    watched = Lock(
        client, "watched", timeout=1.5, min_replicas=1, auto_renew=True, watchdog=watchdog
    )
    assert watched.acquire(blocking=False)
    wait_until(lambda: watched.lease.renewals >= 2, 10, "two renewals")
    replica.pause()
    try:
        deadline = lock.lease.deadline
        with pytest.raises(ReplicationError):
            lock.extend(5)
        assert lock.lease.deadline == deadline  # not counted
        wait_until(lambda: watched.lease.known_lost, 10, "the watched lease to be lost")
        assert "renewed" in watched.lease.loss_reason
    finally:
        replica.resume()
    lock.release()


def test_a_server_that_is_a_replica_refuses_locks(pair, caplog):
    """READONLY: a client still pointed at a demoted master gets no lock, and the log says why."""
    _, replica = pair
    caplog.set_level(logging.WARNING, logger=REPLICATION_LOG)
    lock = Lock(replica.client(), "job", timeout=10, min_replicas=1)
    with pytest.raises(ReplicationError) as info:
        lock.acquire(blocking=False)
    assert info.value.event == "demoted"
    assert "reports itself a replica (READONLY)" in caplog.records[-1].getMessage()


def test_a_master_below_its_min_replicas_to_write_refuses_locks(pair, caplog):
    """NOREPLICAS: the server's own min-replicas-to-write is not met: the lock is refused."""
    master, _ = pair
    client = master.client()
    caplog.set_level(logging.WARNING, logger=REPLICATION_LOG)
    client.config_set("min-replicas-to-write", 2)
    try:
        with pytest.raises(ReplicationError) as info:
            Lock(client, "job", timeout=10, min_replicas=1).acquire(blocking=False)
    finally:
        client.config_set("min-replicas-to-write", 0)
    assert info.value.event == "isolated"
    assert "refuses writes (NOREPLICAS)" in caplog.records[-1].getMessage()
    assert client.get("job") is None


def test_a_counter_behind_never_repeats_a_fence(pair):
    """A promoted replica's counter may lag the old master's: replicated fences start from
    the server clock instead of repeating the fences the lag hides."""
    master, _ = pair
    client = master.client()
    fence_key = fence_key_for("job")
    lock = Lock(client, "job", timeout=10, min_replicas=1, replica_timeout=HEALTHY)
    handed_out = []
    for _ in range(3):
        assert lock.acquire(blocking=False)
        handed_out.append(lock.fence)
        lock.release()
    # What a promoted replica would hold if the last three draws never reached it.
    client.set(fence_key, handed_out[0] - 1)
    assert lock.acquire(blocking=False)
    assert lock.fence > max(handed_out)
    seconds, micros = client.time()
    assert lock.fence <= seconds * 1_000_000 + micros  # drawn from the clock
    lock.release()
    # Without replicated acquisition the counter is trusted: the fence repeats.
    client.set(fence_key, handed_out[0] - 1)
    plain = Lock(client, "job", timeout=10)
    assert plain.acquire(blocking=False)
    assert plain.fence == handed_out[0]
    plain.release()


def test_a_single_connection_client_cannot_wait_for_replicas(pair):
    """WAIT must follow the write on its connection: a single-connection client is refused."""
    master, _ = pair
    client = master.client(single_connection_client=True)
    with pytest.raises(ConfigurationError, match="connection pool") as info:
        Lock(client, "job", timeout=5, min_replicas=1)
    assert info.value.setting == "min_replicas"


def test_a_refused_acquisition_leaves_nothing_unread_on_the_connection(pair):
    """After a WAIT that timed out, the next command on the connection reads its own reply."""
    master, replica = pair
    client = master.client()
    replica.pause()
    try:
        with pytest.raises(ReplicationError):
            Lock(client, "job", timeout=10, min_replicas=1, replica_timeout=0.1).acquire()
        client.set("after", "mine")
        assert client.get("after") == b"mine"
    finally:
        replica.resume()
    lock = Lock(client, "job", timeout=10, min_replicas=1, replica_timeout=HEALTHY)
    assert lock.acquire(blocking=False)
    lock.release()


def test_worker_start_warns_when_a_master_has_too_few_replicas(pair):
    """More replicas required than connected: a WARNING with both counts, not an error."""
    master, _ = pair
    app = Celery(f"replicas-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(redlock_url=master.url, redlock_min_replicas=2)
    summary = check_lock_store(app)
    assert "each lock is confirmed by 2 replica(s)" in summary
    assert "has 1 replica(s) connected and redlock_min_replicas is 2" in summary
    app.conf.redlock_min_replicas = 1
    summary = check_lock_store(app)
    assert "answers" in summary and "; each lock is confirmed by 1 replica(s)" in summary
    assert "WARNING" not in summary
    store_for(app).close()


def test_batched_renewals_share_one_wait_behind_their_scripts(pair):
    """Renewals pipelined over several script calls are confirmed by one WAIT behind them;
    unacknowledged, none of them counts and the leases are lost in time."""
    master, replica = pair
    client = master.client()
    watchdog = Watchdog(batch_size=2)  # five leases: three script calls per pass
    locks = [
        Lock(client, f"batch{i}", timeout=1.5, min_replicas=1, replica_timeout=1.0,
             auto_renew=True, watchdog=watchdog)
        for i in range(5)
    ]  # fmt: skip
    for lock in locks:
        assert lock.acquire(blocking=False)
    master.reset_stats()
    wait_until(lambda: all(lock.lease.renewals >= 2 for lock in locks), 20, "renewals")
    stats = master.commandstats()
    assert 1 <= stats["wait"] < stats["evalsha"], stats  # fewer WAITs than script calls
    assert all(replica.client().pttl(lock.name) > 0 for lock in locks)
    replica.pause()
    try:
        wait_until(lambda: all(lock.lease.lost for lock in locks), 20, "the leases to be lost")
    finally:
        replica.resume()
