"""What fencing leaves in the store: one counter, however many distinct names were locked.

Fences come from one counter per store (per hash slot on Cluster, see
``test_topology_cluster.py``). These tests drive the lock core on a private
server: 100,000 distinct completed acquisitions leave one key, and fences keep
increasing when that counter expires, is evicted or is lost with a restart.
"""

from __future__ import annotations

import contextlib
import time

import redis

from celery_redlock import Lock, Semaphore
from celery_redlock.core.fences import FENCE_COUNTER, fence_key_for
from celery_redlock.core.scripts import ACQUIRE, RELEASE

#: Acquisitions and releases per pipelined round trip.
BATCH = 2_000


def test_100000_distinct_completed_calls_leave_one_key(redis_server):
    """Acquire and release 100,000 distinct names: the store keeps the one fence counter,
    and every fence drawn exceeds the one before."""
    client = redis_server.client()
    for script in (ACQUIRE, RELEASE):
        client.script_load(script.source)
    last = 0
    for start in range(0, 100_000, BATCH):
        names = [f"fp:v1:{{t.job:{n:08x}}}" for n in range(start, start + BATCH)]
        pipe = client.pipeline(transaction=False)
        for name in names:
            ACQUIRE.queue(pipe, (name, fence_key_for(name)), ("w", 60_000, 3_600_000, "0"))
        for name in names:
            RELEASE.queue(pipe, (name,), ("w", "0"))
        replies = pipe.execute()
        fences = replies[:BATCH]
        assert all(isinstance(fence, int) for fence in fences)
        assert fences == sorted(set(fences)) and fences[0] > last
        assert replies[BATCH:] == [1] * BATCH  # every one released
        last = fences[-1]
    assert client.dbsize() == 1
    assert client.keys("*") == [b"fp:v1:fence"]


def test_locks_and_semaphores_of_distinct_names_share_the_counter(redis_server):
    """The classes pick the store's counter themselves: distinct Locks and Semaphores
    leave nothing but it, and their fences interleave in one increasing sequence."""
    client = redis_server.client()
    fences = []
    for n in range(300):
        lock = Lock(client, f"lock-{n}", timeout=10)
        with lock:
            fences.append(lock.fence)
        semaphore = Semaphore(client, f"sem-{n}", limit=2, timeout=10)
        with semaphore:
            fences.append(semaphore.fence)
    assert fences == sorted(set(fences))
    assert client.keys("*") == [FENCE_COUNTER.encode()]


def test_fences_rise_across_expiry_eviction_and_a_restart_without_data(redis_server):
    """The counter lost any way (its retention lapsed, evicted under memory pressure, a
    restart with an empty dataset) reseeds from the clock, above every earlier fence."""
    client = redis_server.client()

    def fence_of(name: str, **options) -> int:
        lock = Lock(client, name, timeout=10, **options)
        with lock:
            assert lock.fence is not None
            return lock.fence

    fences = [fence_of("a"), fence_of("b")]

    # Expiry: a store unused for longer than the retention.
    fences.append(fence_of("c", fence_retention=0.05))
    time.sleep(0.2)
    assert not client.exists(FENCE_COUNTER)
    fences.append(fence_of("a"))

    # Eviction: any key may go under allkeys-random once memory runs out.
    client.config_set("maxmemory-policy", "allkeys-random")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 2_000_000)
    filler = b"x" * 10_000
    for n in range(5_000):
        with contextlib.suppress(redis.exceptions.OutOfMemoryError):
            client.set(f"filler-{n}", filler)
        if not client.exists(FENCE_COUNTER):
            break
    assert not client.exists(FENCE_COUNTER), "the counter was never evicted"
    client.config_set("maxmemory", 0)
    fences.append(fence_of("b"))

    # A restart that lost the dataset.
    redis_server.restart()
    client = redis_server.client()
    assert client.dbsize() == 0
    fences.append(fence_of("a"))
    fences.append(fence_of("c"))
    assert fences == sorted(set(fences))
