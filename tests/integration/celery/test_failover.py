"""Ten identical calls through two real workers while Sentinel fails the lock store over.

The scenario that let a duplicate run: worker A's pool processes hold
connections to the master, the Sentinels promote its replica, and for some
seconds the old master still takes writes. Calls that reach A would be granted
there while calls that reach B (fresh connections, the new master) are granted
too. With replicated acquisition (``redlock_min_replicas`` "auto": 1 on this
store) neither master can confirm a lock until the old one replicates the new
one: the calls are requeued meanwhile (``lock_on_redis_error="requeue"``), then
exactly one runs and the others meet its lock and are skipped.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.celery_apps import failover
from tests.celery_harness import CeleryWorker, History, start_all, task_states, wait_until
from tests.redis_topologies import MASTER_NAME, LocalSentinel

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

CALLS = 10
#: How long the one call that runs holds its lock: longer than the others take
#: to come back from their requeues and meet it.
HOLD = 6.0


@pytest.fixture
def group(redis_server_binary: str, tmp_path: Path) -> Iterator[LocalSentinel]:
    """1 master, 1 replica, 3 Sentinels, stopped by pid at the end."""
    with LocalSentinel(redis_server_binary, tmp_path / "sentinel") as running:
        yield running


def worker(env: dict[str, str], queues: list[str], name: str, log_dir: Path) -> CeleryWorker:
    return CeleryWorker(
        "tests.celery_apps.failover",
        pool="prefork",
        concurrency=2,
        queues=queues,
        nodename=f"{name}-{env['REDLOCK_TEST_PREFIX']}@failover",
        log_dir=log_dir,
        env=env,
    )


@pytest.mark.timeout(180)
def test_ten_identical_calls_during_a_failover_run_once(group, redis_server, tmp_path):
    """SENTINEL FAILOVER, then 10 identical calls on two workers: 1 SUCCESS, 9 SKIPPED."""
    prefix = f"fo{uuid.uuid4().hex[:8]}"
    queue, warm_queue = f"{prefix}.q", f"{prefix}.warm"
    env = failover.environment(
        broker=redis_server.url, lock_url=group.url, prefix=prefix, queue=queue
    )
    app = failover.create_app(env)
    sync = app.tasks[failover.TASK]
    warm = worker(env, [queue, warm_queue], "warm", tmp_path / "workers")
    fresh = worker(env, [queue], "fresh", tmp_path / "workers")
    try:
        start_all([warm, fresh], timeout=60)
        # Both of the warm worker's pool processes connect to the current master.
        warmups = [sync.apply_async((f"warm{i}", 1.0), queue=warm_queue) for i in range(2)]
        assert [r.get(timeout=30).split(":")[0] for r in warmups]
        (replica,) = group.replicas
        group.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        group.wait_for_master(replica)
        # The Sentinels name the new master; the old one still takes writes.
        assert group.master.client().info("replication")["role"] == "master"
        ids = [sync.delay("acme", HOLD).id for _ in range(CALLS)]

        def settled() -> bool:
            states = task_states(app, ids)
            return all(state in ("SUCCESS", "SKIPPED", "FAILURE") for state, _ in states.values())

        wait_until(settled, 120, interval=0.2, message="the ten calls to settle")
        states = task_states(app, ids)
        outcome = Counter(state for state, _ in states.values())
        assert outcome == {"SUCCESS": 1, "SKIPPED": CALLS - 1}, (
            outcome,
            warm.log_tail(30),
            fresh.log_tail(30),
        )
        history = History(redis_server.client(), prefix)
        runs = [e for e in history.executions() if e.key == sync.lock_key_for("acme", HOLD)]
        assert len(runs) == 1
        assert "could not have the lock confirmed by its replicas" in warm.log() + fresh.log()
    finally:
        for one in (warm, fresh):
            one.request_stop()
        for one in (warm, fresh):
            one.stop()
        app.close()
