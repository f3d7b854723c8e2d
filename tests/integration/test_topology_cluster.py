"""The lock and SingletonTask on a local 3-master Redis Cluster (``redlock_url = redis+cluster://...``).

The cluster is built once for the module with ``redis-cli --cluster create`` on
free loopback ports; each test uses its own key prefix.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redlock import SKIPPED, SingletonTask, current_lock
from celery_redlock.celery.bootsteps import check_lock_store
from celery_redlock.core.lock import fence_key_for
from celery_redlock.core.renewal import Watchdog
from celery_redlock.core.store import LockStore, parse_store
from tests.grant_history import Locker, check_grants, lockers
from tests.hand_driven import ManualClock, NeverStarted
from tests.redis_topologies import LocalCluster, wait_replicas_online, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(redis_server_binary, tmp_path_factory) -> Iterator[LocalCluster]:
    """A 3-master Redis Cluster, stopped by pid at the end of the module."""
    with LocalCluster(redis_server_binary, tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture
def store(cluster) -> Iterator[LockStore]:
    """The lock store as the Celery layer builds it from the setting."""
    built = LockStore(parse_store({"redlock_url": cluster.url}))
    yield built
    built.close()


def keys_on(cluster: LocalCluster, pattern: str) -> list[bytes]:
    return sorted(key for node in cluster.nodes for key in node.client().scan_iter(pattern))


def test_lock_is_exclusive_and_its_fence_shares_the_lock_keys_slot(cluster, store):
    """Acquire, contend, release on a Cluster; lock and its slot's fence counter share a slot."""
    name = f"c1:v1:{{t.job:{uuid.uuid4().hex}}}"
    first, second = store.lock(name, timeout=5), store.lock(name, timeout=5)
    assert first.acquire(blocking=False)
    assert not second.acquire(blocking=False)
    node = cluster.node_of(name)
    admin = node.client()
    assert admin.get(name) == first.token
    counter = fence_key_for(name, cluster=True)
    assert admin.cluster("keyslot", name) == admin.cluster("keyslot", counter)
    fence = first.fence
    assert int(admin.get(counter)) == fence
    first.release()
    assert second.acquire(blocking=False)
    assert second.fence > fence
    second.release()
    # The slot's counter of the prefix is all that stays.
    assert counter.encode() in keys_on(cluster, "c1:*")
    assert all(key.startswith(b"c1:v1:fence:{") for key in keys_on(cluster, "c1:*"))


def test_watchdog_renews_locks_of_every_slot_without_cross_slot_commands(cluster, store):
    """Locks spread over all three masters are all renewed: no script spans two slots."""
    watchdog = Watchdog()
    names = [f"c2:v1:{{t.job:{i}}}" for i in range(12)]
    assert len({cluster.node_of(name).port for name in names}) == 3
    locks = [store.lock(name, timeout=0.6, auto_renew=True, watchdog=watchdog) for name in names]
    for lock in locks:
        assert lock.acquire(blocking=False)
    # Several renewal passes: each lease is renewed at a third of its TTL.
    wait_until(lambda: all(lock.lease.renewals >= 3 for lock in locks), 10, "three renewals each")
    assert not any(lock.lost for lock in locks)
    for lock in locks:
        assert 0 < cluster.node_of(lock.name).client().pttl(lock.name) <= 600
        lock.release()
    assert keys_on(cluster, "c2:*:{t.job:?}") == []


def test_worker_start_checks_every_master(cluster):
    """The worker-start check pings each primary of the Cluster."""
    app = Celery(f"cluster-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.redlock_url = cluster.url
    summary = check_lock_store(app)
    assert summary.startswith("lock store Redis Cluster via") and "answers" in summary
    assert "unreachable" not in summary


def test_singleton_task_end_to_end_on_a_cluster(cluster, redis_server):
    """A SingletonTask locks on the Cluster: duplicate SKIPPED, fences rise, nothing left."""
    prefix = f"c3{uuid.uuid4().hex[:6]}"
    app = Celery(f"cluster-{prefix}", set_as_current=False)
    app.conf.update(
        broker_url=redis_server.url,
        result_backend=redis_server.url,
        task_default_queue=f"q-{prefix}",
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=False,
        redlock_url=cluster.url,
        redlock_key_prefix=prefix,
        redlock_ttl=3,
    )
    started, finish = threading.Event(), threading.Event()

    @app.task(base=SingletonTask, name="t.sync_on_cluster")
    def sync(account):
        started.set()
        finish.wait(10)
        lease = current_lock()
        assert lease is not None and not lease.lost
        return lease.fence

    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        first = sync.delay("acme")
        assert started.wait(10)
        key = sync.lock_key_for("acme")
        assert cluster.node_of(key).client().exists(key)
        second = sync.delay("acme")
        deadline = time.monotonic() + 10
        while second.state != SKIPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert second.state == SKIPPED and second.info["holder"] == first.id
        finish.set()
        fence = first.get(timeout=10)
        # The lock is free as soon as the result is visible, on whichever node holds it.
        assert sync.delay("acme").get(timeout=10) > fence
    # Nothing stays but the prefix's fence counter of the key's slot.
    assert keys_on(cluster, f"{prefix}:*") == [fence_key_for(key, cluster=True).encode()]


def test_semaphore_on_a_cluster_runs_every_script_on_its_keys_node(cluster, store):
    """Permits, fence and wait list share the name's slot: acquire, refusal, a woken
    blocking waiter and watchdog renewal all work on a Cluster, on one node."""
    from celery_redlock.core.semaphore_scripts import semaphore_keys

    name = f"c3:v1:{{t.job:{uuid.uuid4().hex}}}"
    watchdog = Watchdog()
    holders = [
        store.lock(name, limit=2, timeout=0.6, auto_renew=True, watchdog=watchdog, blocking=False)
        for _ in range(2)
    ]
    assert all(holder.acquire() for holder in holders)
    waiter = store.lock(name, limit=2, timeout=5, sleep=0.05, thread_local=False)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(blocking_timeout=20)))
    thread.start()
    keys = semaphore_keys(name, cluster=True)
    node = cluster.node_of(name).client()
    wait_until(lambda: node.zcard(keys.waiters) == 1, 10, "the waiter to queue")
    wait_until(lambda: all(h.lease.renewals >= 2 for h in holders), 10, "two renewals each")
    holders[0].release()
    thread.join(20)
    assert got == [True] and waiter.slot == holders[0].lease.slot
    assert waiter.fence > max(h.lease.fence for h in holders)
    assert node.zcard(keys.permits) == 2
    slots = {node.cluster("keyslot", key) for key in (name, keys.permits, keys.fence, keys.wake)}
    assert len(slots) == 1
    holders[1].release()
    waiter.release()
    assert node.zcard(keys.permits) == 0


def test_acquires_in_line_run_on_the_keys_node(cluster, store):
    """A lock and a semaphore acquired in line (fair requeue) keep their wait line in the
    name's slot: the one-script round trip works on a Cluster, oldest waiter first."""
    from celery_redlock.core.queue_scripts import Place, queue_keys

    for limit in (1, 2):
        name = f"c3:v1:{{t.fair:{uuid.uuid4().hex}}}"
        holders = [store.lock(name, limit=limit, timeout=5, blocking=False) for _ in range(limit)]
        assert all(h.acquire(place=Place(f"h{i}", None, 5000, 9000)) for i, h in enumerate(holders))
        old, new = (store.lock(name, limit=limit, timeout=5, blocking=False) for _ in range(2))
        assert not old.acquire(place=Place("old", None, 5000, 9000))
        assert not new.acquire(place=Place("new", None, 5000, 9000))
        holders[0].release()
        assert not new.acquire(place=Place("new", None, 5000, 9000))
        assert old.acquire(place=Place("old", old.refusal.arrival_us, 5000, 9000))
        node = cluster.node_of(name).client()
        assert node.zrange(queue_keys(name)[0], 0, -1) == [b"new"]
        assert len({node.cluster("keyslot", key) for key in (name, *queue_keys(name))}) == 1


@pytest.mark.timeout(180)
def test_cluster_failover_under_steady_locking(redis_server_binary, tmp_path):
    """CLUSTER FAILOVER of one shard (6 nodes: 3 masters, 1 replica each) while a warm and
    a fresh client lock keys on every shard: never two holders, never a repeated fence.

    With a replica in every shard, "auto" confirms each lock with one replica.
    The manual failover moves the shard's slots to its replica and makes the
    old master its replica; a warm client's next command there is redirected
    (MOVED) to the new master, where its locks go on.
    """
    with LocalCluster(redis_server_binary, tmp_path / "cluster6", replicas=1) as cluster:

        def store() -> LockStore:
            conf = {"redlock_url": cluster.url, "redlock_replica_timeout": 2.0}
            return LockStore(parse_store(conf))

        keys = [f"c4:v1:{{t.job:{i}}}" for i in range(9)]
        assert len({cluster.node_of(key).port for key in keys}) == 3
        probe = store()
        assert probe.min_replicas() == 1
        probe.close()
        warm = Locker("warm", store, keys).start()
        wait_until(lambda: warm.granted_since(0) >= 30, 30, "grants before the failover")
        old = cluster.node_of(keys[0])
        promoted = cluster.replica_of(old)
        promoted.client().execute_command("CLUSTER", "FAILOVER")
        wait_until(
            lambda: promoted.client().info("replication")["role"] == "master",
            30,
            "the replica to take over its shard",
        )
        fresh = Locker("fresh", store, keys).start()
        wait_replicas_online(promoted, 1, timeout=30)  # the old master follows it
        recovered = time.monotonic()
        moved = [key for key in keys if cluster.node_of(key).port == promoted.port]

        def progressed() -> bool:
            after = [g for g in warm.grants + fresh.grants if g.start > recovered]
            return (
                warm.granted_since(recovered) >= 10
                and fresh.granted_since(recovered) >= 10
                and any(g.key in moved for g in after)
            )

        wait_until(progressed, 30, "both clients to lock on every shard again")
        check_grants(lockers(warm, fresh))


def test_distinct_names_leave_one_fence_counter_per_slot(cluster, store):
    """1,000 distinct names locked and released leave nothing but one counter per slot
    they hash to, and each slot's fences strictly increase."""
    from redis.crc import key_slot

    prefix = f"c6{uuid.uuid4().hex[:6]}"
    by_slot: dict[int, list[int]] = {}
    for n in range(1_000):
        name = f"{prefix}:v1:{{t.job:{n}}}"
        lock = store.lock(name, timeout=10)
        assert lock.acquire(blocking=False)
        by_slot.setdefault(key_slot(name.encode()), []).append(lock.fence)
        lock.release()
    assert all(fences == sorted(set(fences)) for fences in by_slot.values())
    expected = {
        fence_key_for(f"{prefix}:v1:{{t.job:{n}}}", cluster=True).encode() for n in range(1_000)
    }
    assert len(expected) == len(by_slot)
    assert set(keys_on(cluster, f"{prefix}:*")) == expected  # the counters, and nothing else


def test_watchdog_renews_every_slot_in_one_round_trip_per_node(cluster, store, monkeypatch):
    """600 locks over hundreds of slots: a renewal pass sends one script call per slot,
    all in one pipelined write per master, and renews every lock once."""
    import redis.connection

    from celery_redlock import Lock
    from celery_redlock.core.scripts import RENEW

    clock = ManualClock()
    watchdog = Watchdog(clock=clock)
    watchdog._thread = NeverStarted()  # passes driven by hand
    client = store.client
    prefix = f"c7{uuid.uuid4().hex[:6]}"
    locks = [
        Lock(client, f"{prefix}:v1:{{t.job:{n}}}", timeout=60, clock=clock) for n in range(600)
    ]
    for lock in locks:
        assert lock.acquire(blocking=False)
        watchdog.watch(lock.lease)
    slots_per_node = {node.port: set() for node in cluster.nodes}
    for lock in locks:
        slots_per_node[cluster.node_of(lock.name).port].add(client.keyslot(lock.name))
    assert all(len(slots) > 50 for slots in slots_per_node.values())

    client.script_load(RENEW.source)  # every master knows it, as after any first pass
    writes: dict[int, int] = {}
    send = redis.connection.AbstractConnection.send_packed_command

    def counting(self, *args, **kwargs):
        writes[self.port] = writes.get(self.port, 0) + 1
        return send(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    for node in cluster.nodes:
        node.reset_stats()
    for period in (1, 2):
        clock.now += 20  # a third of the TTL
        writes.clear()
        watchdog.renew_due()
        assert writes == {node.port: 1 for node in cluster.nodes}
        assert [lock.lease.renewals for lock in locks] == [period] * 600
    monkeypatch.undo()
    for node in cluster.nodes:
        calls = node.commandstats().get("evalsha", 0)
        assert calls == 2 * len(slots_per_node[node.port])  # one call per slot and pass
    assert not any(lock.lost for lock in locks)
    for lock in locks:
        lock.release()
