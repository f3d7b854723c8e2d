"""Per-queue locking of plain tasks, configured by ``redlock_queues`` or ``--redlock-queues``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redlock import SKIPPED
from celery_redlock.core.keys import KeyBuilder
from tests.celery_harness import History, wait_until
from tests.integration.celery.conftest import APP_MODULE, WorkerFactory
from tests.integration.celery.test_storms import submit, wait_for_states

REPO = Path(__file__).resolve().parents[3]
STORM = 100


@pytest.fixture
def locked_queue(queue: str) -> str:
    """A second queue of the test, the one locking applies to."""
    return f"{queue}.locked"


@pytest.fixture
def queue_config(request: pytest.FixtureRequest, locked_queue: str) -> Any:
    """The test's ``redlock_queues``, chosen by indirect parametrisation (default: none)."""
    shape = getattr(request, "param", None)
    if shape == "list":
        return [locked_queue]
    if shape == "mapping":
        return {locked_queue: {"ttl": 5, "on_conflict": "skip"}}
    if shape == "requeue":
        return {
            locked_queue: {
                "on_conflict": "requeue",
                "requeue_delay": 0.05,
                "requeue_max_delay": 0.2,
                "max_requeues": 10000,
            }
        }
    if shape == "typo":
        return {locked_queue: {"tll": 5}}
    return None


@pytest.fixture
def storm_env(storm_env: dict[str, str], queue_config: Any) -> dict[str, str]:
    """The storm app's environment plus this test's ``redlock_queues``."""
    if queue_config is None:
        return storm_env
    return {**storm_env, "REDLOCK_TEST_QUEUES": json.dumps(queue_config)}


def plain_key(app: Celery, *args: Any) -> str:
    """The lock key of a storm.plain call, as a locked queue's guard computes it."""
    task = app.tasks["storm.plain"]
    return KeyBuilder(task.name, task.run, None, app.conf.redlock_key_prefix).key_for(args, {})


def assert_duplicates_skipped(
    app: Celery,
    history: History,
    db9: redis.Redis,
    queue: str,
    gate: str,
    x: int = 1,
    duplicates: int = 1,
) -> None:
    """Hold plain call ``x`` from ``queue`` open; its duplicates skip, it runs once, locked."""
    task = app.tasks["storm.plain"]
    first = task.apply_async((x, 0, gate), queue=queue).id
    key = plain_key(app, x, 0, gate)
    # Started either way; an unlocked start fails here at once rather than at a timeout.
    wait_until(
        lambda: db9.exists(key) or history.running(f"unlocked:{x}"),
        40,
        message=f"the first call {x} to start",
    )
    assert db9.exists(key), f"call {x} from the locked queue {queue} runs without a lock"
    sent = submit(task, (x, 0, gate), duplicates, queue=queue)
    states = wait_for_states(app, sent, {SKIPPED, "SUCCESS"}, timeout=30)
    assert {state for state, _ in states.values()} == {SKIPPED}, states
    assert {info["holder"] for _, info in states.values()} == {first}
    db9.set(gate, 1)
    assert app.AsyncResult(first).get(timeout=20) == x
    runs = [e for e in history.executions() if e.task_id == first]
    assert len(runs) == 1 and runs[0].extra["locked"]
    history.assert_no_overlap_per_key()


def storm_of_plain_calls(app: Celery, history: History, queue: str, gate: str) -> tuple[str, list]:
    """Send one plain call to ``queue``, wait until it holds its lock, then STORM - 1 duplicates."""
    task = app.tasks["storm.plain"]
    first = task.apply_async((1, 0, gate), queue=queue).id
    key = plain_key(app, 1, 0, gate)
    wait_until(lambda: history.client.exists(key), 30, message=f"the first call to take {key}")
    return first, submit(task, (1, 0, gate), STORM - 1, queue=queue)


def assert_deduplicated(
    app: Celery, history: History, db9: redis.Redis, first: str, duplicates: list, gate: str
) -> None:
    states = wait_for_states(app, duplicates, {SKIPPED}, timeout=60)
    assert {info["holder"] for _, info in states.values()} == {first}
    db9.set(gate, 1)
    assert app.AsyncResult(first).get(timeout=20) == 1
    (execution,) = history.executions()
    assert execution.task_id == first and execution.extra["locked"]


@pytest.mark.parametrize("queue_config", ["list", "mapping"], indirect=True)
@pytest.mark.timeout(120)
def test_plain_task_from_a_configured_queue_runs_once_in_a_storm(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    queue: str,
    locked_queue: str,
    prefix: str,
) -> None:
    """A plain @app.task from a queue in redlock_queues is deduplicated: 1 run, 99 skipped."""
    worker_factory.start(
        worker_factory.create("prefork", 2, queues=[queue, locked_queue]),
        worker_factory.create("threads", 4, queues=[queue, locked_queue]),
    )
    gate = f"{prefix}:gate"
    first, duplicates = storm_of_plain_calls(storm_app, history, locked_queue, gate)
    assert_deduplicated(storm_app, history, db9, first, duplicates, gate)


@pytest.mark.parametrize("queue_config", ["list"], indirect=True)
@pytest.mark.timeout(120)
def test_the_same_task_from_an_unconfigured_queue_is_not_locked(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    queue: str,
    locked_queue: str,
    prefix: str,
) -> None:
    """Routed to a queue that is not locked, duplicates of a plain task run side by side."""
    worker_factory("threads", 8, queues=[queue, locked_queue])
    gate = f"{prefix}:gate"
    task = storm_app.tasks["storm.plain"]
    ids = submit(task, (1, 0, gate), 8, queue=queue)
    wait_until(
        lambda: history.running("unlocked:1") == 8,
        30,
        message=lambda: f"8 unlocked runs at once; running {history.running('unlocked:1')}",
    )
    db9.set(gate, 1)
    assert [storm_app.AsyncResult(i).get(timeout=20) for i in ids] == [1] * 8
    assert not any(e.extra["locked"] for e in history.executions())


@pytest.mark.timeout(120)
def test_worker_option_alone_turns_locking_on(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    db9: redis.Redis,
    queue: str,
    locked_queue: str,
    prefix: str,
) -> None:
    """--redlock-queues with no redlock_queues setting locks that queue on that worker."""
    worker_factory(
        "prefork",
        2,
        queues=[queue, locked_queue],
        extra_args=[f"--redlock-queues={locked_queue}"],
    )
    gate = f"{prefix}:gate"
    first, duplicates = storm_of_plain_calls(storm_app, history, locked_queue, gate)
    assert_deduplicated(storm_app, history, db9, first, duplicates, gate)


@pytest.mark.parametrize("queue_config", ["requeue"], indirect=True)
@pytest.mark.timeout(120)
def test_per_queue_requeue_serialises_without_loss(
    storm_app: Celery,
    worker_factory: WorkerFactory,
    history: History,
    queue: str,
    locked_queue: str,
) -> None:
    """A queue configured with on_conflict=requeue runs every duplicate, one at a time."""
    worker_factory.start(
        worker_factory.create("prefork", 2, queues=[queue, locked_queue]),
        worker_factory.create("threads", 4, queues=[queue, locked_queue]),
    )
    task = storm_app.tasks["storm.plain"]
    ids = submit(task, (1, 0.02), 30, queue=locked_queue)
    assert [storm_app.AsyncResult(i).get(timeout=90) for i in ids] == [1] * 30
    executions = history.executions()
    assert sorted(e.task_id for e in executions) == sorted(ids)
    assert all(e.extra["locked"] for e in executions)
    history.assert_no_overlap_per_key()
    history.assert_fences_increase_per_key()


def run_celery(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP_MODULE, *args],
        env={**os.environ, **env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def run_worker_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """Run ``celery -A <storm app> worker ...`` to completion (it is expected to exit)."""
    return run_celery(env, "worker", *args)


@pytest.mark.parametrize("queue_config", ["typo"], indirect=True)
def test_a_bad_setting_stops_the_worker_with_one_readable_line(
    storm_env: dict[str, str], locked_queue: str, queue: str
) -> None:
    """A misspelt option in redlock_queues makes `celery worker` exit 1, naming it."""
    done = run_worker_cli(storm_env, "-Q", f"{queue},{locked_queue}", "-P", "solo")
    assert done.returncode != 0
    expected = (
        f"celery-redlock: configuration error: redlock_queues[{locked_queue!r}]=['tll']: "
        "unknown option(s); known: ttl, key, on_conflict"
    )
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unconsumed_queue_on_the_command_line_stops_the_worker(
    storm_env: dict[str, str], queue: str
) -> None:
    """--redlock-queues naming a queue the worker does not consume is refused at start."""
    done = run_worker_cli(storm_env, "-Q", queue, "-P", "solo", "--redlock-queues=nope")
    assert done.returncode != 0
    assert "celery-redlock: configuration error: --redlock-queues='nope': is not a queue" in (
        done.stderr
    )


def test_worker_help_lists_the_option(storm_env: dict[str, str]) -> None:
    """`celery worker --help` shows --redlock-queues and what it does."""
    done = run_worker_cli(storm_env, "--help")
    assert done.returncode == 0
    assert "--redlock-queues" in done.stdout
    assert "celery-redlock" in done.stdout


@pytest.mark.parametrize("queue_config", ["mapping"], indirect=True)
def test_redlock_check_reports_the_store_and_queues(
    storm_env: dict[str, str], locked_queue: str
) -> None:
    """`celery redlock check` names the lock store and locked queues and exits 0."""
    done = run_celery(storm_env, "redlock", "check")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("lock store redis://127.0.0.1:6379/9 (Redis ")
    assert f"locked queues: {locked_queue}" in done.stdout
    assert "answers: acquire, renew and release ran under" in done.stdout


@pytest.mark.parametrize("queue_config", ["typo"], indirect=True)
def test_redlock_check_fails_on_a_bad_setting(storm_env: dict[str, str]) -> None:
    """`celery redlock check` exits 1 with the same one-line error a worker would print."""
    done = run_celery(storm_env, "redlock", "check")
    assert done.returncode == 1
    assert "celery-redlock: configuration error: redlock_queues[" in done.stderr
