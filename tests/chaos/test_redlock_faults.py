"""Redlock over five masters while a minority of them is killed, hung or restarted empty.

The Celery layer takes a single lock-store URL so far, so this scenario drives
:class:`celery_redlock.Redlock` directly from three driver processes
(``tests.chaos.redlock_driver``) contending for two locks, and judges their
history with the same checker as the Celery scenarios.

At most two of the five masters are faulty at any moment, and a master that
restarts empty does so only after every lock taken while another master was
down has been released: Redlock promises safety while a majority of the
masters that granted a lock still hold it (see docs/redlock.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.celery_harness import REDIS_URL, REPO_ROOT, delete_prefixed_keys, wait_until
from tests.chaos import report
from tests.chaos.checker import check, load_executions, load_outcomes
from tests.chaos.history import FencedStore, stop_key, submitted_key
from tests.redis_servers import RedisServer

# Every scenario runs REPEATS times (the ``attempt`` fixture of conftest.py).
pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.usefixtures("attempt")]

MASTERS = 5
DRIVERS = 3
TTL = 1.0
HOLD = 0.2
#: Finished holds, all started after a fault (or repair), that show the lock still works.
PROGRESS = 4


@pytest.fixture
def history() -> Iterator[tuple[redis.Redis, str]]:
    """A client on db 9 and a run prefix; the prefix's keys are deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL)
    run = f"rlr-{uuid.uuid4().hex[:12]}"
    try:
        yield client, run
    finally:
        delete_prefixed_keys(client, run)
        client.close()


def start_drivers(
    masters: list[RedisServer], run: str, log_dir: Path
) -> list[subprocess.Popen[bytes]]:
    """Start the driver processes; they run until the run's stop key is set."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(DRIVERS):
        config = {
            "masters": [master.url for master in masters],
            "history": REDIS_URL,
            "run": run,
            "name": f"d{i}",
            "resources": ["a", "b"],
            "ttl": TTL,
            "hold": HOLD,
            "wait": 3.0,
        }
        with open(log_dir / f"driver{i}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.chaos.redlock_driver", json.dumps(config)],
                    cwd=REPO_ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


@pytest.mark.timeout(90)
def test_redlock_with_a_minority_of_masters_killed_hung_and_restarted_empty(
    redis_servers: Callable[[int], list[RedisServer]],
    history: tuple[redis.Redis, str],
    tmp_path: Path,
) -> None:
    """Holds never overlap, fences rise and nothing is lost while two of five masters fail."""
    client, run = history
    masters = redis_servers(MASTERS)

    def progress(since: float) -> Callable[[], bool]:
        def enough() -> bool:
            done = [e for e in load_executions(client, run) if e.start > since and e.finished]
            return len(done) >= PROGRESS

        return enough

    def wait_progress(what: str) -> None:
        wait_until(progress(time.time()), 30, interval=0.1, message=f"holds {what}")

    procs = start_drivers(masters, run, tmp_path / "drivers")
    faults = 0
    try:
        wait_progress("before any fault")
        masters[0].kill()
        masters[1].pause()
        faults += 2
        # Longer than the TTL: locks held on the hung master expire there meanwhile.
        wait_until(progress(time.time() + TTL), 30, interval=0.1, message="holds on 3 of 5")
        masters[1].resume()
        masters[0].restart()  # back, empty
        faults += 1
        wait_progress("after the repair")
        masters[2].restart()
        faults += 1
        wait_progress("after a restart empty")
    finally:
        client.set(stop_key(run), 1)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "drivers").glob("*.log")))
    assert all(proc.returncode == 0 for proc in procs), logs[-3000:]

    submitted = [raw.decode() for raw in client.lrange(submitted_key(run), 0, -1)]
    executions = load_executions(client, run)
    verdict = check(executions, FencedStore(client, run), submitted, load_outcomes(client, run))
    report.record(
        "Redlock, 5 masters: minority killed, hung, restarted empty", verdict, faults=faults
    )
    assert not verdict.violations, verdict.describe()
    assert not verdict.lost, verdict.describe()
    assert verdict.outcomes["executed"] >= 4 * PROGRESS, verdict.describe()
