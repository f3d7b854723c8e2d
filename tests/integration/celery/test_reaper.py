"""The continuous reaper in real workers: only provably dead holders lose their locks.

The workers run the reaper every 0.5 s and count a worker silent after 1 s.
Each test waits for a number of *passes* (counted by the worker and read by
remote control), never for a length of time, before it checks that a lock
was left alone. The locks live 60 s, so their own expiry never explains a
release the tests wait for (20 s at most).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redlock.celery.reaper import Reaper
from celery_redlock.core.holder import Holder
from celery_redlock.core.semaphore_scripts import RENEW_PERMITS, semaphore_keys
from celery_redlock.core.store import LockStore, parse_store
from tests.celery_apps.limits import started
from tests.celery_harness import CeleryWorker, wait_until
from tests.integration.celery.conftest import WorkerFactory
from tests.processes import dead_pid

LONG_TTL = 60.0


@pytest.fixture
def storm_env(storm_env: dict[str, str]) -> dict[str, str]:
    settings = {"redlock_reaper_interval": 0.5, "redlock_reaper_unresponsive_after": 1.0}
    return {
        **storm_env,
        "REDLOCK_TEST_INSTALL": "1",
        "REDLOCK_TEST_TTL": str(LONG_TTL),
        "REDLOCK_TEST_SETTINGS": json.dumps(settings),
    }


@pytest.fixture
def gates(db9: redis.Redis, worker_factory: WorkerFactory) -> Iterator[list[str]]:
    opened: list[str] = []
    yield opened
    for gate in opened:
        db9.set(gate, 1)


def hold(app: Celery, db9: redis.Redis, prefix: str, gates: list[str], x: Any) -> str:
    """Start ``storm.hold(x)`` behind a gate; return its lock key once taken."""
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    gates.append(gate)
    task = app.tasks["storm.hold"]
    key = task.lock_key_for(x, 0, gate)
    task.apply_async((x, 0, gate))
    wait_until(lambda: db9.exists(key), timeout=20, message=f"lock {key} taken")
    return key


def report(app: Celery, worker: CeleryWorker) -> dict[str, Any]:
    replies = app.control.broadcast(
        "redlock_stats", reply=True, timeout=3, destination=[worker.nodename]
    )
    merged: dict[str, Any] = {}
    for reply in replies:
        merged.update(reply)
    return merged[worker.nodename]


def passes(app: Celery, worker: CeleryWorker) -> int:
    return int(report(app, worker)["reaper_passes"])


def wait_for_passes(app: Celery, worker: CeleryWorker, more: int) -> None:
    """Wait until the worker's reaper has made ``more`` further passes."""
    target = passes(app, worker) + more
    wait_until(lambda: passes(app, worker) >= target, timeout=30, message=f"{more} passes")


def plant(db9: redis.Redis, key: str, holder: Holder, left_ms: int) -> bytes:
    value = holder.encode().encode()
    db9.set(key, value, px=left_ms)
    return value


def foreign(node: str, host: str, pid: int) -> Holder:
    """A holder of a 60 s lock on ``node`` at ``host``, acquired now."""
    return Holder(
        task_id=f"foreign-{uuid.uuid4().hex[:8]}",
        hostname=node,
        pid=pid,
        token=uuid.uuid4().hex,
        acquired_ms=int(time.time() * 1000),
        ttl_ms=int(LONG_TTL * 1000),
        host=host,
    )


@pytest.mark.timeout(120)
def test_a_killed_pool_process_lock_goes_and_live_or_remote_holders_stay(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
) -> None:
    """SIGKILL of the pool process holding a 60 s lock: the running worker's reaper frees it;
    the lock of a live task on the same host, and one of "another host", are never touched."""
    worker = worker_factory("prefork", 2)
    live_key = hold(storm_app, db9, prefix, gates, "live")
    doomed_key = hold(storm_app, db9, prefix, gates, "doomed")
    live_value = db9.get(live_key)
    doomed = Holder.parse(db9.get(doomed_key))
    assert doomed is not None and doomed.pid in worker.child_pids()
    # Same node name, a pid that does not exist here, but another host: no proof.
    remote_key = f"{prefix}:v1:{{storm.hold:{'cd' * 32}}}"
    remote_value = plant(
        db9, remote_key, foreign(worker.nodename, "another-host", dead_pid()), 60_000
    )

    wait_for_passes(storm_app, worker, 2)
    assert db9.get(doomed_key) is not None  # nothing to reap while the holder runs
    assert db9.pttl(doomed_key) > 40_000
    os.kill(doomed.pid, signal.SIGKILL)
    wait_until(
        lambda: not db9.exists(doomed_key), timeout=20, message="the dead holder's lock freed"
    )

    assert worker.running
    log = worker.log()
    assert f"reaper released lock {doomed_key}" in log
    assert f"holder pid {doomed.pid} of this worker ({worker.nodename})" in log
    wait_for_passes(storm_app, worker, 4)
    assert db9.get(live_key) == live_value
    assert db9.get(remote_key) == remote_value
    counts = report(storm_app, worker)["reaped"]
    assert counts == {"pid_gone": 1, "worker_silent": 0}


@pytest.mark.timeout(90)
def test_a_silent_workers_lock_goes_only_once_its_renewals_stopped(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """A node that never answers loses a lock past its renewal deadline (half its TTL gone),
    not one renewed recently; the release names both pieces of evidence."""
    worker = worker_factory("solo")
    ghost = f"ghost-{prefix}@far-away"
    overdue_key = f"{prefix}:v1:{{storm.hold:{'01' * 32}}}"
    fresh_key = f"{prefix}:v1:{{storm.hold:{'02' * 32}}}"
    plant(db9, overdue_key, foreign(ghost, "far-away", 4242), 25_000)  # 35 s since renewal
    fresh_value = plant(db9, fresh_key, foreign(ghost, "far-away", 4243), 59_000)

    wait_until(lambda: not db9.exists(overdue_key), timeout=20, message="overdue lock freed")
    log = worker.log()
    assert f"reaper released lock {overdue_key}" in log
    assert f"worker {ghost} (host far-away) has not answered a ping" in log
    wait_for_passes(storm_app, worker, 4)
    assert db9.get(fresh_key) == fresh_value
    assert report(storm_app, worker)["reaped"] == {"pid_gone": 0, "worker_silent": 1}


def permits_by_task(db9: redis.Redis, name: str) -> dict[str, bytes]:
    """The members of semaphore ``name``'s permits, by their holder's task id."""
    found = {}
    for member in db9.zrange(semaphore_keys(name).permits, 0, -1):
        holder = Holder.parse(member.split(b"|", 2)[2])
        assert holder is not None
        found[holder.task_id] = bytes(member)
    return found


def plant_permits(
    db9: redis.Redis, name: str, holders: dict[int, tuple[Holder, int]]
) -> dict[int, bytes]:
    """Permits of semaphore ``name`` by slot: ``(holder, ms left)``; return their members."""
    seconds, micros = db9.time()
    now_ms = seconds * 1000 + micros // 1000
    members = {
        slot: f"{slot}|{100 + slot}|{holder.encode()}".encode()
        for slot, (holder, _) in holders.items()
    }
    key = semaphore_keys(name).permits
    db9.zadd(key, {members[slot]: now_ms + left for slot, (_, left) in holders.items()})
    db9.pexpire(key, 60_000)
    return members


@pytest.mark.timeout(120)
def test_a_killed_pool_process_permit_goes_and_the_other_holders_keep_theirs(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
) -> None:
    """SIGKILL of the pool process holding one permit of a 60 s semaphore: the running
    worker's reaper removes exactly that permit; the live holder beside it keeps its own."""
    worker = worker_factory("prefork", 2)
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    gates.append(gate)
    for _ in range(2):
        storm_app.tasks["limits.lasting"].apply_async(("g", 0, gate))
    wait_until(lambda: len(started(db9, prefix)) == 2, timeout=20, message="two holders")
    doomed, live = started(db9, prefix)
    name, permits = doomed["key"], semaphore_keys(doomed["key"]).permits
    members = permits_by_task(db9, name)
    assert doomed["pid"] in worker.child_pids()

    wait_for_passes(storm_app, worker, 2)
    assert permits_by_task(db9, name) == members  # nothing to reap while the holders run
    seconds, _ = db9.time()
    assert db9.zscore(permits, members[doomed["task_id"]]) > (seconds + 40) * 1000
    os.kill(doomed["pid"], signal.SIGKILL)
    wait_until(
        lambda: db9.zscore(permits, members[doomed["task_id"]]) is None,
        timeout=20,
        message="the dead holder's permit freed",
    )

    assert worker.running
    log = worker.log()
    assert f"reaper released permit {doomed['slot']} of semaphore {name}" in log
    assert f"holder pid {doomed['pid']} of this worker ({worker.nodename})" in log
    wait_for_passes(storm_app, worker, 4)
    assert permits_by_task(db9, name) == {live["task_id"]: members[live["task_id"]]}
    assert report(storm_app, worker)["reaped"] == {"pid_gone": 1, "worker_silent": 0}


@pytest.mark.timeout(60)
def test_a_permit_renewed_between_the_read_and_the_release_stays(
    storm_app: Celery, db9: redis.Redis, prefix: str
) -> None:
    """Two permits of a silent worker, both past their renewal deadline when read: the one
    its holder renews before the release (here, while the reaper pings) stays; the other goes."""
    ghost = f"ghost-{prefix}@far-away"
    name = f"{prefix}:v1:{{limits.lasting:{'03' * 32}}}"
    members = plant_permits(
        db9,
        name,
        {
            0: (foreign(ghost, "far-away", 4242), 25_000),
            1: (foreign(ghost, "far-away", 4243), 25_000),
        },
    )
    permits = semaphore_keys(name).permits

    def renew_then_stay_silent(app: Celery, nodes: Any, timeout: float) -> set[str]:
        # What the holder's watchdog sends: its permit is set back to its full TTL.
        RENEW_PERMITS(db9, (permits,), ("1", members[1], 60_000))
        return set()

    reaper = Reaper(
        storm_app,
        f"judge-{prefix}@here",
        interval=60.0,
        unresponsive_after=0.0,
        store=LockStore(parse_store(storm_app.conf)),
        ping=renew_then_stay_silent,
    )
    try:
        reaped = reaper.run_once()
    finally:
        reaper.store.close()
    assert [(r.permit and r.permit.member, r.verdict.reason) for r in reaped] == [
        (members[0].decode(), "worker_silent")
    ]
    assert db9.zrange(permits, 0, -1) == [members[1]]


@pytest.mark.timeout(120)
def test_a_permit_whose_worker_answers_stays_though_it_looks_overdue(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
) -> None:
    """Permits past their renewal deadline: a silent node's goes; one naming a worker that
    answers its pings stays, and so does a fresh permit of the silent node."""
    judge, alive = worker_factory.start(
        worker_factory.create("solo"), worker_factory.create("solo")
    )
    ghost = f"ghost-{prefix}@far-away"
    name = f"{prefix}:v1:{{limits.lasting:{'04' * 32}}}"
    members = plant_permits(
        db9,
        name,
        {
            0: (foreign(ghost, "far-away", 4242), 25_000),
            1: (foreign(alive.nodename, "far-away", 4243), 25_000),
            2: (foreign(ghost, "far-away", 4244), 59_000),
        },
    )
    permits = semaphore_keys(name).permits

    wait_until(
        lambda: db9.zscore(permits, members[0]) is None,
        timeout=20,
        message="the silent node's overdue permit freed",
    )
    log = judge.log() + alive.log()
    assert f"reaper released permit 0 of semaphore {name}" in log
    assert f"worker {ghost} (host far-away) has not answered a ping" in log
    assert "the permit was last renewed" in log
    wait_for_passes(storm_app, judge, 4)
    assert sorted(db9.zrange(permits, 0, -1)) == sorted([members[1], members[2]])
    reaped = [report(storm_app, w)["reaped"] for w in (judge, alive)]
    assert sum(counts["worker_silent"] for counts in reaped) == 1
    assert sum(counts["pid_gone"] for counts in reaped) == 0


@pytest.mark.timeout(120)
def test_a_silent_workers_lock_goes_only_once_its_holder_counts_it_lost(
    storm_app: Celery, db9: redis.Redis, prefix: str
) -> None:
    """However long its worker has been silent, a lock goes only once at most half its TTL
    less the silence limit is left: its holder, if only cut off, counts it lost by then."""
    ghost = f"ghost-{prefix}@far-away"
    keys = [f"{prefix}:v1:{{storm.hold:{n * 32}}}" for n in ("0a", "0b")]
    now = [0.0]
    reaper = Reaper(
        storm_app,
        f"judge-{prefix}@here",
        interval=60.0,
        unresponsive_after=10.0,
        store=LockStore(parse_store(storm_app.conf)),
        ping=lambda app, nodes, timeout: set(),  # the ghost never answers
        clock=lambda: now[0],
    )
    try:
        # 60 s locks, overdue both (renewals stopped 35 s and 41 s ago), one by more
        # than the 10 s of silence (at most 20 s left).
        plant(db9, keys[0], foreign(ghost, "far-away", 4242), 25_000)
        plant(db9, keys[1], foreign(ghost, "far-away", 4243), 19_000)
        assert reaper.run_once() == []  # the silence starts
        now[0] = 1e6
        assert [r.info.key for r in reaper.run_once()] == [keys[1]]
        assert db9.exists(keys[0])
    finally:
        reaper.store.close()


@pytest.mark.timeout(60)
def test_a_redlock_master_down_does_not_stop_the_reaper(redis_servers) -> None:
    """With one of three masters unreachable, a dead holder's lock still goes from the others."""
    live = redis_servers(2)
    app = Celery("reaper-redlock", set_as_current=False)
    down = "redis://127.0.0.1:1/0?socket_connect_timeout=0.2&socket_timeout=0.2"
    app.conf.redlock_url = [server.url for server in live] + [down]
    node = "prefork-reaper@here"
    holder = Holder(
        task_id="t-1",
        hostname=node,
        pid=dead_pid(),
        token=uuid.uuid4().hex,
        acquired_ms=int(time.time() * 1000),
        ttl_ms=60_000,
        host=socket.gethostname(),
    )
    key = "redlock:v1:{t.x:" + "0c" * 32 + "}"
    for server in live:
        plant(server.client(), key, holder, 60_000)
    reaper = Reaper(
        app, node, interval=60.0, unresponsive_after=60.0, store=LockStore(parse_store(app.conf))
    )
    try:
        reaped = reaper.run_once()
    finally:
        reaper.store.close()
    assert [(r.info.key, r.verdict.reason) for r in reaped] == [(key, "pid_gone")]
    assert not any(server.client().exists(key) for server in live)
