"""Operator tooling against real workers: the ``celery redlock`` commands, stats and recovery.

The commands run in this process through click's ``CliRunner`` with the
test's twin of the workers' app (and once as a real ``celery`` subprocess,
through the entry point). Remote control reaches only this test's workers:
the app's control exchange is named after the test's prefix, and every
request names its destination.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_redlock.core.fences import counter_for
from celery_redlock.ops.cli import redlock
from tests.celery_harness import REPO_ROOT, CeleryWorker, WorkerError, task_states, wait_until
from tests.integration.celery.conftest import WorkerFactory

#: TTL of the tests' locks: long enough that expiry never explains a release.
LONG_TTL = 60.0


@pytest.fixture
def storm_env(storm_env: dict[str, str]) -> dict[str, str]:
    """The storm app installed (stats, recovery) with a long default lock TTL."""
    return {**storm_env, "REDLOCK_TEST_INSTALL": "1", "REDLOCK_TEST_TTL": str(LONG_TTL)}


@pytest.fixture
def gates(db9: redis.Redis, worker_factory: WorkerFactory) -> Iterator[list[str]]:
    """Gate keys of the test's held calls; opened at teardown, so workers stop at once."""
    opened: list[str] = []
    yield opened
    for gate in opened:
        db9.set(gate, 1)


def invoke(app: Celery, *args: str, input: str | None = None) -> Result:
    """Run ``celery redlock <args>`` in this process against ``app``."""
    runner = CliRunner()
    return runner.invoke(
        redlock, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), input=input
    )


def hold(
    app: Celery,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
    x: Any,
    queue: str | None = None,
) -> tuple[str, str, str]:
    """Start ``storm.hold(x)`` behind a gate opened at teardown; return (task id, key, gate)."""
    task = app.tasks["storm.hold"]
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    gates.append(gate)
    key = task.lock_key_for(x, 0, gate)
    result = task.apply_async((x, 0, gate), queue=queue)
    wait_until(lambda: db9.exists(key), timeout=20, message=f"lock {key} taken")
    return result.id, key, gate


@pytest.mark.timeout(60)
def test_list_shows_the_holder_and_ttl(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
) -> None:
    """`list` names the holding task, its worker and pool process, and the TTL left."""
    worker = worker_factory("prefork", 2)
    before = time.time()
    task_id, key, _gate = hold(storm_app, db9, prefix, gates, 1)

    result = invoke(storm_app, "list", "--json", "--task", "storm.hold")
    assert result.exit_code == 0, result.output
    (listed,) = json.loads(result.output)
    assert listed["key"] == key
    assert listed["task"] == "storm.hold"
    assert listed["holder"]["task_id"] == task_id
    assert listed["holder"]["hostname"] == worker.nodename
    assert listed["holder"]["pid"] in worker.child_pids()
    assert listed["holder"]["queue"] == worker.queues[0]
    assert 0 < listed["ttl"] <= LONG_TTL
    assert listed["holder"]["ttl_ms"] == LONG_TTL * 1000
    assert before - 1 <= listed["acquired_at"] <= time.time()
    assert listed["fence"] is not None and listed["fence"] > 0
    assert listed["renewals"] == 0  # a renewal is due only after a third of 60 s

    text = invoke(storm_app, "list")
    assert text.exit_code == 0, text.output
    assert task_id in text.output and worker.nodename in text.output and key in text.output
    assert "1 lock(s)" in text.output
    # Filters that match nothing list nothing.
    assert json.loads(invoke(storm_app, "list", "--json", "--queue", "elsewhere").output) == []
    assert json.loads(invoke(storm_app, "list", "--json", "--task", "storm.plain").output) == []


@pytest.mark.timeout(60)
def test_celery_program_runs_the_commands_through_its_entry_point(
    storm_env: dict[str, str],
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
) -> None:
    """`celery -A app redlock list` and `show` work as a real command (entry point plugin)."""
    worker_factory("solo")
    task_id, key, _gate = hold(storm_app, db9, prefix, gates, 2)
    env = {**os.environ, **storm_env}
    command = [sys.executable, "-m", "celery", "-A", "tests.celery_apps.storm", "redlock"]
    listed = subprocess.run(
        [*command, "list"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert listed.returncode == 0, listed.stderr
    assert task_id in listed.stdout and key in listed.stdout
    shown = subprocess.run(
        [*command, "show", key],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"holder task id  {task_id}" in shown.stdout


@pytest.mark.timeout(60)
def test_release_refuses_a_live_holder_unless_forced(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
) -> None:
    """`release` leaves the lock of a worker that answers ping; `--force` deletes it."""
    worker = worker_factory("threads", 2)  # a busy solo worker could not answer the ping
    _task_id, key, _gate = hold(storm_app, db9, prefix, gates, 3)
    value = db9.get(key)

    refused = invoke(storm_app, "release", key)
    assert refused.exit_code == 1
    assert (
        "refused" in refused.output and f"worker {worker.nodename} answers ping" in refused.output
    )
    assert db9.get(key) == value

    forced = invoke(storm_app, "release", key, "--force")
    assert forced.exit_code == 0, forced.output
    assert f"released {key} (forced)" in forced.output
    assert not db9.exists(key)

    missing = invoke(storm_app, "show", key)
    assert missing.exit_code == 1 and "no task lock" in missing.output


@pytest.mark.timeout(60)
def test_purge_dry_run_deletes_nothing(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
) -> None:
    """`purge --dry-run` lists the locks it would delete and leaves every one; purge deletes."""
    worker_factory("threads", 2)
    held = [hold(storm_app, db9, prefix, gates, x)[1] for x in (4, 5)]
    values = {key: db9.get(key) for key in held}

    dry = invoke(storm_app, "purge", "--all", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert all(f"would delete {key}" in dry.output for key in held)
    assert "nothing was deleted" in dry.output
    assert {key: db9.get(key) for key in held} == values
    assert db9.exists(counter_for(held[0]))  # the prefix's fence counter is no lock

    declined = invoke(storm_app, "purge", "--task", "storm.hold", input="n\n")
    assert declined.exit_code == 1 and {key: db9.get(key) for key in held} == values

    done = invoke(storm_app, "purge", "--task", "storm.hold", "--yes")
    assert done.exit_code == 0, done.output
    assert "deleted 2 lock(s)" in done.output
    assert not any(db9.exists(key) for key in held)
    assert db9.exists(counter_for(held[0]))  # fences keep increasing

    assert invoke(storm_app, "purge").exit_code == 2  # neither --task nor --all


@pytest.mark.timeout(60)
def test_stats_count_a_scripted_run(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
) -> None:
    """`stats` reports exactly N acquired, M skipped, N released, counted in the pool processes."""
    worker = worker_factory("prefork", 2)
    acquired, skipped = 5, 4
    task = storm_app.tasks["storm.hold"]
    holder_id, _key, gate = hold(storm_app, db9, prefix, gates, 0)
    duplicates = [task.delay(0, 0, gate).id for _ in range(skipped)]
    wait_until(
        lambda: all(state == "SKIPPED" for state, _ in task_states(storm_app, duplicates).values()),
        timeout=20,
        message="duplicates skipped",
    )
    others = [task.delay(x, 0).id for x in range(1, acquired)]
    db9.set(gate, 1)
    everything = [holder_id, *others]
    wait_until(
        lambda: all(s == "SUCCESS" for s, _ in task_states(storm_app, everything).values()),
        timeout=20,
        message="calls done",
    )

    result = invoke(storm_app, "stats", "--json", "-d", worker.nodename, "--timeout", "3")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert list(report["workers"]) == [worker.nodename]
    assert report["workers"][worker.nodename]["processes"] == 2
    counts = report["totals"]["storm.hold"]
    assert counts == {
        "acquired": acquired,
        "skipped": skipped,
        "requeued": 0,
        "raised": 0,
        "lost": 0,
        "released": acquired,
    }
    text = invoke(storm_app, "stats", "-d", worker.nodename, "--timeout", "3")
    assert text.exit_code == 0, text.output
    assert f"workers: {worker.nodename}" in text.output
    assert "storm.hold  5         4        0         0       0     5" in text.output


def restart(factory: WorkerFactory, worker: CeleryWorker, *extra: str) -> CeleryWorker:
    """Start a new worker with ``worker``'s node name, pool and queues; stopped at teardown."""
    again = CeleryWorker(
        worker.app_module,
        pool=worker.pool,
        concurrency=worker.concurrency,
        queues=worker.queues,
        nodename=worker.nodename,
        log_dir=factory.log_dir,
        env=factory.env,
        extra_args=list(extra),
    )
    again.log_path = worker.log_path.with_suffix(f".{len(factory.workers)}.log")
    factory.workers.append(again)
    factory.start(again)
    return again


@pytest.mark.timeout(90)
def test_restart_after_kill_9_releases_only_the_dead_incarnations_locks(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
) -> None:
    """A worker restarted after kill -9 frees its old 60 s lock at once; a live peer's stays.

    The restart with --no-redlock-recover leaves the stale lock: the option
    turns recovery off.
    """
    doomed = worker_factory.create("prefork", 2)
    peer = worker_factory.create("solo", 1, queues=[f"{prefix}.peer"])
    worker_factory.start(doomed, peer)
    _stale_id, stale_key, _ = hold(storm_app, db9, prefix, gates, "stale")
    _live_id, live_key, _ = hold(storm_app, db9, prefix, gates, "live", peer.queues[0])
    live_value = db9.get(live_key)
    stale_holder = json.loads(invoke(storm_app, "show", stale_key, "--json").output)["holder"]
    assert stale_holder["hostname"] == doomed.nodename

    children = doomed.child_pids()
    doomed.kill()  # SIGKILL the main process; its pool processes die with it
    wait_until(
        lambda: not any(os.path.exists(f"/proc/{pid}") for pid in children),
        timeout=10,
        message="pool processes gone",
    )
    assert db9.pttl(stale_key) > (LONG_TTL - 30) * 1000

    kept = restart(worker_factory, doomed, "--no-redlock-recover")
    assert db9.exists(stale_key), "recovery ran although --no-redlock-recover"
    kept.stop()

    again = restart(worker_factory, doomed)
    # Freed by recovery, not by expiry: the worker logs the release, and a lock
    # left to expire (30 s or more were left) never gets that line.
    wait_until(
        lambda: f"released stale lock {stale_key}" in again.log(),
        timeout=20,
        message="the restarted worker's release of the stale lock",
    )
    assert not db9.exists(stale_key)
    assert db9.get(live_key) == live_value  # the live peer's lock is untouched
    assert peer.running


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", ["redlock_recover_stale", "redlock_stats"])
def test_worker_refuses_to_start_with_a_non_bool_operations_setting(
    storm_env: dict[str, str], worker_factory: WorkerFactory, setting: str
) -> None:
    """A worker exits at start with one line naming the setting and its bad value."""
    worker_factory.env = {**storm_env, "REDLOCK_TEST_SETTINGS": json.dumps({setting: "yes"})}
    worker = worker_factory.create("solo")
    worker.spawn()
    with pytest.raises(WorkerError, match="exited with"):
        worker.wait_ready(timeout=30)
    assert f"celery-redlock: configuration error: {setting}='yes'" in worker.log()
