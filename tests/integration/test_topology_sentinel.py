"""The lock through Redis Sentinel (1 master, 1 replica, 3 Sentinels) and across failovers.

The store is built from kombu's syntax: ``sentinel://host:port;...`` plus
``master_name`` in ``redlock_transport_options``. The last tests show the
caveat of a failover without replicated acquisition (a lock written on the old
master but not yet replicated is lost with it, and can be taken again on the
promoted replica, with the same fence) and how replicated acquisition, the
default on a Sentinel store with replicas, refuses that lock in the first place.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from celery_redlock import LockNotOwned, ReplicationError
from celery_redlock.core.lock import fence_key_for
from celery_redlock.core.store import LockStore, parse_store
from tests.grant_history import Locker, check_grants, lockers
from tests.redis_servers import LOOPBACK, RedisServer
from tests.redis_topologies import MASTER_NAME, LocalSentinel, wait_replicas_online, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


@pytest.fixture
def group(redis_server_binary, tmp_path) -> Iterator[LocalSentinel]:
    """A fresh Sentinel group for each test: failovers change who is master."""
    with LocalSentinel(redis_server_binary, tmp_path / "sentinel") as running:
        yield running


def store_of(group: LocalSentinel, **settings: object) -> LockStore:
    conf = {
        "redlock_url": group.url,
        "redlock_transport_options": {"master_name": MASTER_NAME},
        # A replica starved of CPU on a busy machine must not fail a test.
        "redlock_replica_timeout": 2.0,
        **settings,
    }
    # Short timeouts: after a failover the old master's connections must fail fast.
    spec = parse_store(conf)
    return LockStore(spec)


def rejoin(group: LocalSentinel, new_master: RedisServer) -> None:
    """Restart the crashed old master as a replica of ``new_master``; wait until it is in sync."""
    group.master.extra_args += ("--replicaof", LOOPBACK, str(new_master.port))
    group.master.restart()
    wait_replicas_online(new_master, 1)


def replicated(group: LocalSentinel) -> None:
    """Wait until the replica has every write the master took so far."""
    assert group.master.client().wait(1, 5000) == 1


@pytest.mark.timeout(120)
def test_lock_through_sentinel_survives_a_forced_failover(group):
    """After SENTINEL FAILOVER new acquisitions work, and a replicated lock stays held."""
    store = store_of(group)
    name = f"s1:v1:{{t.job:{uuid.uuid4().hex}}}"
    held = store.lock(name, timeout=30)
    assert held.acquire(blocking=False)
    assert group.master_port() == group.master.port
    assert group.master.client().get(name) == held.token
    replicated(group)

    (replica,) = group.replicas
    group.failover(to=replica)
    # Sentinel demotes the old master some seconds later; until it replicates
    # the new one, the new master has no replica to confirm locks.
    wait_replicas_online(replica, 1, timeout=40)

    # The same store follows the new master: the replicated lock is still held...
    other = store.lock(name, timeout=30)
    assert not other.acquire(blocking=False)
    # ...new locks are taken there, with fences above the replicated one...
    fresh = store.lock(f"s1:v1:{{t.job:{uuid.uuid4().hex}}}", timeout=30)
    assert fresh.acquire(blocking=False)
    assert replica.client().get(fresh.name) == fresh.token
    # ...and the holder extends and releases on the new master.
    fence = held.fence
    held.extend(10)
    held.release()
    assert other.acquire(blocking=False)
    assert other.fence > fence
    other.release()
    fresh.release()
    store.close()


def test_unreplicated_lock_is_lost_in_failover_without_replicated_acquisition(group):
    """With redlock_min_replicas=0: a lock the replica never saw is granted again after failover.

    Replication is asynchronous: the master grants the lock and answers before
    the replica has the write. Here the replica is frozen and its link cut
    before the first holder acquires, and the master dies before the replica
    can catch up. Sentinel promotes the replica, which never saw the lock, and
    a second holder acquires it while the first still believes it holds it.
    The fence does not order them: both drew it from the same replicated
    counter, so both hold the same fence.
    """
    store = store_of(group, redlock_min_replicas=0)
    name = f"s2:v1:{{t.job:{uuid.uuid4().hex}}}"
    (replica,) = group.replicas
    # A first acquisition the replica does see: the fence counter exists on both.
    warm = store.lock(name, timeout=30)
    assert warm.acquire(blocking=False)
    warm.release()
    replicated(group)

    replica.pause()  # SIGSTOP: it can neither read nor reconnect
    group.master.client().execute_command("CLIENT", "KILL", "TYPE", "replica")
    first = store.lock(name, timeout=30)
    assert first.acquire(blocking=False)
    assert group.master.client().info("replication")["connected_slaves"] == 0
    group.master.kill()  # the write dies with the master, never sent anywhere
    replica.resume()

    group.wait_for_master(replica)
    assert replica.client().get(name) is None  # the replica never saw the first holder

    second = store.lock(name, timeout=30)
    assert second.acquire(blocking=False)  # two holders of one lock at once
    assert first.lease is not None and first.remaining() > 0  # the first one does not know
    assert second.fence == first.fence  # equal fences: no way to order the two
    # What the first holder learns, at its next renewal or release at the latest:
    with pytest.raises(LockNotOwned):
        first.release()
    second.release()
    store.close()


def test_semaphore_through_sentinel_takes_and_frees_permits_on_the_master(group):
    """The semaphore through the Sentinel-discovered master: permits on the master,
    the third caller refused, a permit freed by its release taken again."""
    from celery_redlock.core.semaphore_scripts import semaphore_keys

    store = store_of(group)
    name = f"s3:v1:{{t.job:{uuid.uuid4().hex}}}"
    first, second, third = (store.lock(name, limit=2, timeout=30, blocking=False) for _ in "abc")
    assert first.acquire() and second.acquire()
    assert not third.acquire()
    assert third.refusal.held == 2 and third.refusal.limit == 2
    assert group.master.client().zcard(semaphore_keys(name).permits) == 2
    first.release()
    assert third.acquire() and third.fence > second.fence


@pytest.mark.timeout(120)
def test_replicated_acquisition_refuses_the_lock_the_replica_never_saw(group):
    """The same failover with replicated acquisition (auto: 1 replica): the first holder is
    refused and its grant given back, so the promoted replica's holder is the only one,
    with a fence above every fence the old master drew."""
    store = store_of(group)
    name = f"s3:v1:{{t.job:{uuid.uuid4().hex}}}"
    (replica,) = group.replicas
    warm = store.lock(name, timeout=30)
    assert warm.replication is not None and warm.replication.replicas == 1
    assert warm.acquire(blocking=False)
    warm.release()

    replica.pause()
    old_master = group.master.client()
    old_master.execute_command("CLIENT", "KILL", "TYPE", "replica")
    first = store.lock(name, timeout=30, replica_timeout=0.2)
    with pytest.raises(ReplicationError) as info:
        first.acquire(blocking=False)
    assert info.value.acknowledged == 0
    assert old_master.get(name) is None  # given back before the master dies
    drawn = int(old_master.get(fence_key_for(name)))  # the counter moved on all the same
    group.master.kill()
    replica.resume()
    group.wait_for_master(replica)
    # The crashed master comes back as a replica of the new one, as Sentinel
    # would reconfigure it: the new master has a replica to confirm locks again.
    rejoin(group, replica)

    second = store.lock(name, timeout=30)
    assert second.acquire(blocking=False)  # the only holder
    assert second.fence > drawn > warm.lease.fence
    second.release()
    store.close()


def failover_keys(tag: str) -> list[str]:
    return [f"{tag}:v1:{{t.job:{i}}}" for i in range(4)]


@pytest.mark.timeout(120)
def test_sentinel_failover_under_steady_locking(group):
    """SENTINEL FAILOVER while a warm client (connected to the old master) and a fresh one
    lock the same keys: never two holders of a key, never a repeated fence.

    The old master stays writable for some seconds after the replica is
    promoted. The warm client's acquisitions there get no replica's
    acknowledgement (its replica left), so they are given back and refused,
    as are the fresh client's on the new master until the old one rejoins as
    its replica; then both lock on the new master.
    """
    keys = failover_keys("s4")
    (replica,) = group.replicas
    warm = Locker("warm", lambda: store_of(group), keys).start()
    wait_until(lambda: warm.granted_since(0) >= 20, 20, "grants before the failover")
    group.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
    group.wait_for_master(replica)
    fresh = Locker("fresh", lambda: store_of(group), keys).start()
    wait_replicas_online(replica, 1, timeout=60)  # the old master, demoted, replicates
    recovered = time.monotonic()
    wait_until(
        lambda: warm.granted_since(recovered) >= 10 and fresh.granted_since(recovered) >= 10,
        30,
        "both clients to lock on the new master",
    )
    grants = lockers(warm, fresh)
    check_grants(grants)
    assert warm.outcomes["ReplicationError"] > 0, warm.outcomes


@pytest.mark.timeout(120)
def test_master_killed_under_steady_locking(group):
    """SIGKILL of the master under steady locking: no two holders, no repeated fence.

    Every lock granted before the crash was acknowledged by the replica, so the
    promoted replica holds it; the new master confirms locks again once the
    crashed one is back as its replica.
    """
    keys = failover_keys("s5")
    (replica,) = group.replicas
    warm = Locker("warm", lambda: store_of(group), keys).start()
    wait_until(lambda: warm.granted_since(0) >= 20, 20, "grants before the crash")
    group.master.kill()
    fresh = Locker("fresh", lambda: store_of(group), keys).start()
    group.wait_for_master(replica)
    rejoin(group, replica)
    recovered = time.monotonic()
    wait_until(
        lambda: warm.granted_since(recovered) >= 10 and fresh.granted_since(recovered) >= 10,
        30,
        "both clients to lock on the new master",
    )
    check_grants(lockers(warm, fresh))
