"""The inventory and stale-lock recovery on real servers: one Redis, and a 3-primary Cluster."""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from celery_redlock import Lock, Semaphore
from celery_redlock.core.holder import Holder
from celery_redlock.core.inventory import find_locks, semaphore_key
from celery_redlock.core.keys import KeyBuilder
from celery_redlock.core.reclaim import delete_permit
from celery_redlock.core.recovery import recover_stale
from celery_redlock.core.semaphore_scripts import RELEASE_PERMIT
from tests.fault_proxy import ReplyDroppingProxy
from tests.processes import dead_pid
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.integration

SLOTS = 16384


def _key(task: str, n: int, prefix: str = "ops") -> str:
    return KeyBuilder(task, lambda n: n, None, prefix).key_for((n,), {})


def _take(client: Any, key: str, holder: Holder, ttl: float = 60) -> None:
    lock = Lock(client, key, timeout=ttl, blocking=False, auto_renew=False)
    assert lock.acquire(token=holder.encode())


def test_find_locks_lists_held_locks_and_skips_fences_and_other_prefixes(r: redis.Redis) -> None:
    """Every lock under the prefix is found once, with holder, TTL and fence; nothing else."""
    keys = [_key("app.a", n) for n in range(250)]  # more than one read batch
    for n, key in enumerate(keys):
        _take(r, key, Holder.new(f"id-{n}", "w1@h", ttl=60, queue="q1" if n % 2 else "q2"))
    _take(r, _key("app.a", 0, prefix="other"), Holder.new("x", "w1@h", ttl=60))
    r.set("ops:unrelated", "1")

    found = {info.key: info for info in find_locks(r, ["ops"])}
    assert set(found) == set(keys)
    first = found[keys[0]]
    assert first.holder is not None and first.holder.task_id == "id-0"
    assert first.ttl is not None and 0 < first.ttl <= 60
    assert first.fence is not None and first.renewals == 0
    assert len(list(find_locks(r, ["ops"], task="app.a", queue="q1"))) == 125
    assert list(find_locks(r, ["ops"], task="app.b")) == []


def test_recovery_releases_only_dead_processes_of_this_node_and_host(r: redis.Redis) -> None:
    """Dead pid + same node + same host: released. Live pid, other node, other host, v1: kept."""
    dead = dead_pid()
    here = Holder.new("t", "w1@h").host
    assert here is not None

    def holder(node: str, pid: int, host: str | None) -> Holder:
        base = Holder.new("t", node, ttl=60)
        return Holder(
            task_id=base.task_id,
            hostname=node,
            pid=pid,
            token=base.token,
            acquired_ms=base.acquired_ms,
            ttl_ms=base.ttl_ms,
            host=host,
        )

    stale = _key("app.a", 1)
    kept = {
        _key("app.a", 2): holder("w1@h", os.getpid(), here),  # alive
        _key("app.a", 3): holder("w2@h", dead, here),  # another node
        _key("app.a", 4): holder("w1@h", dead, "elsewhere"),  # another host
    }
    _take(r, stale, holder("w1@h", dead, here))
    for key, value in kept.items():
        _take(r, key, value)
    v1 = _key("app.a", 5)
    r.set(v1, f"v1|tok|t|w1@h|{dead}", px=60_000)
    # An enqueue lock names its publisher and records no TTL: never recovered.
    enqueued = _key("app.a", 6)
    publisher = holder("w1@h", dead, here)
    r.set(enqueued, Holder(**{**publisher.__dict__, "ttl_ms": 0}).encode(), px=60_000)

    released = recover_stale(r, ["ops"], "w1@h", here)
    assert [info.key for info in released] == [stale]
    assert not r.exists(stale)
    assert all(r.exists(key) for key in [*kept, v1, enqueued])


def _pinned(node: str, pid: int, host: str | None, ttl: float = 60) -> Holder:
    """A holder value of a task of its own on ``node``, naming ``pid`` on ``host``."""
    base = Holder.new(f"t-{random.getrandbits(32):08x}", node, ttl=ttl)
    return Holder(**{**base.__dict__, "pid": pid, "host": host})


def _permits(r: redis.Redis, name: str, *holders: Holder) -> list[Semaphore]:
    """One 60 s permit of the 3-permit semaphore ``name`` per holder, each with its value."""
    taken = []
    for holder in holders:
        sem = Semaphore(r, name, limit=3, timeout=60, blocking=False, auto_renew=False)
        assert sem.acquire(token=holder.encode())
        taken.append(sem)
    return taken


def test_recovery_frees_only_the_dead_processes_permit_of_a_semaphore(r: redis.Redis) -> None:
    """A semaphore's permit left by a dead process of this node and host is removed alone:
    the permits of a live process, of another node and of another host stay."""
    dead, here, name = dead_pid(), Holder.new("t", "w1@h").host, _key("app.s", 1)
    stale, *kept = _permits(
        r,
        name,
        _pinned("w1@h", dead, here),
        _pinned("w1@h", os.getpid(), here),
        _pinned("w2@h", dead, here),
    )
    elsewhere = Semaphore(r, name, limit=4, timeout=60, blocking=False, auto_renew=False)
    assert elsewhere.acquire(token=_pinned("w1@h", dead, "elsewhere").encode())

    released = recover_stale(r, ["ops"], "w1@h", here)
    assert [(info.key, [p.member.encode() for p in info.permits or ()]) for info in released] == [
        (name, [stale.token])
    ]
    held = r.zrange(semaphore_key(name), 0, -1)
    assert sorted(held) == sorted([*(sem.token for sem in kept), elsewhere.token])


def test_a_permit_is_deleted_as_read_and_only_while_its_ttl_is_short_enough(
    r: redis.Redis,
) -> None:
    """delete_permit removes the permit read, not one renewed past the limit given, not one
    released and granted again meanwhile, and never another holder's permit."""
    name, holder = _key("app.s", 2), Holder.new("a", "w1@h", ttl=60)
    first, other = _permits(r, name, holder, Holder.new("b", "w1@h"))
    (info,) = find_locks(r, ["ops"], semaphores=True)
    read = next(p for p in info.permits or () if p.member.encode() == first.token)
    assert not delete_permit(r, info, read, max_left_ms=30_000)  # 60 s left: renewed
    first.release()
    (again,) = _permits(r, name, holder)  # the same holder's value, granted again: a new fence
    assert not delete_permit(r, info, read)
    assert sorted(r.zrange(semaphore_key(name), 0, -1)) == sorted([other.token, again.token])
    (info,) = find_locks(r, ["ops"], semaphores=True)
    read = next(p for p in info.permits or () if p.member.encode() == again.token)
    assert delete_permit(r, info, read, max_left_ms=61_000)
    assert r.zrange(semaphore_key(name), 0, -1) == [other.token]


def test_a_permit_reclaim_whose_reply_was_lost_is_not_sent_again(r: redis.Redis) -> None:
    """A reclaim is never resent: a resend would count a permit its holder released as removed."""
    name = _key("app.s", 3)
    _permits(r, name, Holder.new("a", "w1@h", ttl=60))
    (info,) = find_locks(r, ["ops"], semaphores=True)
    (read,) = info.permits or ()
    r.script_load(RELEASE_PERMIT.source)  # else the reply lost would be NOSCRIPT: nothing ran
    with ReplyDroppingProxy(r.connection_pool.connection_kwargs["port"]) as proxy:
        proxied = redis.Redis.from_url(proxy.url)
        proxied.ping()
        proxy.drop_next_replies(1)
        with pytest.raises(redis.ConnectionError):
            delete_permit(proxied, info, read)
        proxied.close()
    assert r.zrange(semaphore_key(name), 0, -1) == []  # the one send did remove it


def _cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free and valid too."""
    for _ in range(100):
        port = random.randint(20000, 55000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _start_node(workdir: Any) -> RedisServer:
    args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    for attempt in range(5):
        server = RedisServer(
            workdir=workdir / f"try{attempt}", port=_cluster_port(), extra_args=args
        )
        try:
            return server.start()
        except Exception:  # the port was taken in between: pick another
            server.close()
    raise RuntimeError("could not start a cluster node")


@pytest.fixture
def cluster(tmp_path: Any) -> Iterator[RedisCluster]:
    """Three private cluster-enabled servers, each primary for a third of the slots."""
    servers = []
    try:
        for i in range(3):
            servers.append(_start_node(tmp_path / f"node{i}"))
        bounds = [0, SLOTS // 3, 2 * SLOTS // 3, SLOTS]
        for i, server in enumerate(servers):
            admin = server.client()
            admin.execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
            for other in servers:
                if other is not server:
                    admin.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port)
        deadline = time.monotonic() + 20
        while not all(_cluster_ok(server) for server in servers):
            assert time.monotonic() < deadline, "cluster did not converge"
            time.sleep(0.1)
        client = RedisCluster(host="127.0.0.1", port=servers[0].port)
        try:
            yield client
        finally:
            client.close()
    finally:
        for server in servers:
            server.close()


def _cluster_ok(server: RedisServer) -> bool:
    info = server.client().execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text and "cluster_known_nodes:3" in text


@pytest.mark.timeout(60)
def test_find_and_recover_on_a_cluster_scan_every_primary(cluster: RedisCluster) -> None:
    """Locks spread over three primaries are all found, read and released through SCAN per node."""
    keys = [_key("app.c", n) for n in range(60)]
    dead = dead_pid()
    here = Holder.new("t", "n").host
    for n, key in enumerate(keys):
        base = Holder.new(f"id-{n}", "w1@h", ttl=60)
        value = Holder(
            task_id=base.task_id,
            hostname="w1@h",
            pid=dead,
            token=base.token,
            acquired_ms=base.acquired_ms,
            ttl_ms=base.ttl_ms,
            host=here,
        )
        _take(cluster, key, value)
    owners = {cluster.get_node_from_key(key).name for key in keys}
    assert len(owners) == 3  # the test means something only if the keys are spread

    found = list(find_locks(cluster, ["ops"]))
    assert sorted(info.key for info in found) == sorted(keys)
    assert all(info.fence and info.ttl for info in found)

    released = recover_stale(cluster, ["ops"], "w1@h", here)
    assert len(released) == len(keys)
    assert not any(cluster.exists(key) for key in keys)
