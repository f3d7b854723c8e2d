"""Fixtures of the chaos suite, and the hook that prints (and documents) its summary table.

The scenarios of a module share one set of servers and workers, started once
per module, because starting three workers costs more than most scenarios:
private redis-servers as the lock store (one server, five Redlock masters,
or a Sentinel group: one master, one replica, three Sentinels), a private
redis-server as the broker (with an append-only file, so
restarting it drops connections but keeps the queues), and three prefork
workers with two pool processes each. Results, histories and the fenced store
live in db 9 of the shared Redis under the module's key prefix, which no fault
touches. Each scenario names its own run prefix, so histories never mix.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from tests.celery_apps import chaos
from tests.celery_harness import (
    REDIS_URL,
    CeleryWorker,
    WorkerError,
    delete_prefixed_keys,
    start_all,
    task_states,
    wait_until,
)
from tests.chaos import report
from tests.chaos.checker import Execution, Verdict, check, load_executions
from tests.chaos.history import FencedStore
from tests.redis_servers import RedisServer
from tests.redis_topologies import MASTER_NAME, LocalSentinel

APP_MODULE = "tests.celery_apps.chaos"
#: How often each scenario runs; the table sums its runs.
REPEATS = 2
WORKERS = 3
CONCURRENCY = 2
#: Masters of the Redlock lock store.
MASTERS = 5
#: States after which a task will not change any more.
SETTLED = frozenset({"SUCCESS", "FAILURE", "SKIPPED"})


@dataclass
class CeleryChaos:
    """The servers and workers the Celery scenarios fault.

    Attributes:
        lock_stores: The private redis-servers holding the locks: one, or the
            Redlock masters.
        broker: The private redis-server the workers consume from.
        app: The test process's twin of the workers' app (sends, reads results).
        workers: The three workers.
        db9: Client on the shared Redis db 9 (results, histories, fenced store).
        prefix: The module's key prefix.
        sentinel: The Sentinel group of a Sentinel lock store (its master and
            replica are the lock stores then).
    """

    lock_stores: list[RedisServer]
    broker: RedisServer
    app: Celery
    workers: list[CeleryWorker]
    db9: redis.Redis
    prefix: str
    env: dict[str, str]
    log_dir: Path
    runs: list[str] = field(default_factory=list)
    sentinel: LocalSentinel | None = None

    @property
    def lock_store(self) -> RedisServer:
        """The one lock store (not for Redlock, which has several)."""
        (store,) = self.lock_stores
        return store

    def new_run(self) -> str:
        """A fresh key prefix for one scenario run."""
        run = f"{self.prefix}:run{len(self.runs)}"
        self.runs.append(run)
        return run

    def submit(self, task_name: str, run: str, plan: Sequence[tuple[str, float]]) -> list[str]:
        """Send one call per (resource, seconds) of ``plan``; return the task ids."""
        task = self.app.tasks[task_name]
        with self.app.producer_or_acquire() as producer:
            return [
                task.apply_async((run, resource, seconds), producer=producer).id
                for resource, seconds in plan
            ]

    def executions(self, run: str) -> list[Execution]:
        """Every execution of ``run`` recorded so far."""
        return load_executions(self.db9, run)

    def running(self, run: str) -> list[Execution]:
        """Executions of ``run`` that started and have not recorded an end."""
        return [e for e in self.executions(run) if not e.finished]

    def wait_running(self, run: str, count: int, timeout: float = 20) -> list[Execution]:
        """Wait until at least ``count`` executions of ``run`` are running; return them."""
        found: list[Execution] = []

        def enough() -> bool:
            found[:] = self.running(run)
            return len(found) >= count

        wait_until(enough, timeout, message=f"{count} running executions of {run}")
        return found

    def wait_settled(self, task_ids: Sequence[str], timeout: float) -> dict[str, tuple[str, Any]]:
        """Wait until every task is SUCCESS, FAILURE or SKIPPED; return the states."""
        last: dict[str, tuple[str, Any]] = {}

        def settled() -> bool:
            last.update(task_states(self.app, task_ids))
            return all(state in SETTLED for state, _ in last.values())

        wait_until(
            settled,
            timeout,
            interval=0.1,
            message=lambda: f"tasks to settle; have {Counter(s for s, _ in last.values())}",
        )
        return last

    def verdict(
        self, run: str, task_ids: Sequence[str], states: dict[str, tuple[str, Any]]
    ) -> Verdict:
        """Check ``run``'s history (see :mod:`tests.chaos.checker`)."""
        return check(self.executions(run), FencedStore(self.db9, run), task_ids, states)

    def worker_logs(self) -> str:
        """Every worker's log, for assertion messages."""
        return "\n".join(worker.log_tail(15) for worker in self.workers)


@pytest.fixture(params=range(REPEATS), ids=lambda i: f"run{i}")
def attempt(request: pytest.FixtureRequest) -> int:
    """Which run of the scenario this is (every scenario module uses it)."""
    return int(request.param)


def _worker(env: dict[str, str], prefix: str, log_dir: Path, name: str) -> CeleryWorker:
    return CeleryWorker(
        APP_MODULE,
        pool="prefork",
        concurrency=CONCURRENCY,
        queues=[f"{prefix}.q"],
        nodename=f"chaos{name}-{prefix}@chaos",
        log_dir=log_dir,
        env=env,
    )


@contextmanager
def chaos_workers(
    binary: str, base: Path, lock_stores: list[RedisServer], sentinel: LocalSentinel | None = None
) -> Iterator[CeleryChaos]:
    """A private broker and three prefork workers of the chaos app on ``lock_stores``.

    The lock stores are built (not started) by the caller: one server, or
    Redlock masters. Or ``sentinel``, a running group the caller stops: its
    servers are the lock stores. Everything started here is stopped by pid on
    exit.
    """
    if sentinel is not None:
        lock_stores = [sentinel.master, *sentinel.replicas]
    prefix = f"rlc-{uuid.uuid4().hex[:12]}"
    db9 = redis.Redis.from_url(REDIS_URL)
    # fsync on every write: a restart of the broker then loses no message, and
    # the scenario is about dropped connections, not about broker durability.
    broker = RedisServer(
        binary,
        workdir=base / "broker",
        extra_args=("--appendonly", "yes", "--appendfsync", "always"),
    )
    workers: list[CeleryWorker] = []
    app = None
    try:
        for store in lock_stores if sentinel is None else []:
            store.start()
        broker.start()
        urls = [store.url for store in lock_stores]
        env = chaos.environment(
            broker=broker.url,
            backend=REDIS_URL,
            lock_url=sentinel.url if sentinel else urls[0] if len(urls) == 1 else urls,
            prefix=prefix,
            queue=f"{prefix}.q",
            lock_options={"master_name": MASTER_NAME} if sentinel else None,
        )
        app = chaos.create_app(env)
        workers = [_worker(env, prefix, base / "workers", str(i)) for i in range(WORKERS)]
        try:
            start_all(workers, timeout=60)
        except WorkerError as exc:
            pytest.fail(str(exc), pytrace=False)
        chaos_state = CeleryChaos(
            lock_stores, broker, app, workers, db9, prefix, env, base / "workers", sentinel=sentinel
        )
        yield chaos_state
        # Replacements started during the run are stopped as well.
        workers = chaos_state.workers
    finally:
        for worker in workers:
            worker.request_stop()
        for worker in workers:
            worker.stop()
        if app is not None:
            app.close()
        delete_prefixed_keys(db9, prefix)
        db9.close()
        for store in lock_stores if sentinel is None else []:
            store.close()
        broker.close()


@pytest.fixture(scope="module")
def celery_chaos(
    redis_server_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryChaos]:
    """Workers whose lock store is one private redis-server."""
    base = tmp_path_factory.mktemp("chaos")
    lock_store = RedisServer(redis_server_binary, workdir=base / "lock-store")
    with chaos_workers(redis_server_binary, base, [lock_store]) as state:
        yield state


@pytest.fixture(scope="module")
def redlock_chaos(
    redis_server_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryChaos]:
    """Workers whose lock store is Redlock over five private masters (no persistence)."""
    base = tmp_path_factory.mktemp("chaos-redlock")
    masters = [
        RedisServer(redis_server_binary, workdir=base / f"master{i}") for i in range(MASTERS)
    ]
    with chaos_workers(redis_server_binary, base, masters) as state:
        yield state


@pytest.fixture(scope="module")
def sentinel_chaos(
    redis_server_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryChaos]:
    """Workers whose lock store is a Sentinel group (1 master, 1 replica, 3 Sentinels)."""
    base = tmp_path_factory.mktemp("chaos-sentinel")
    with LocalSentinel(redis_server_binary, base / "sentinel") as group:  # noqa: SIM117
        # Two statements: Python 3.9 has no parenthesized context managers.
        with chaos_workers(redis_server_binary, base, [], sentinel=group) as state:
            yield state


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the chaos table after the run.

    With ``REDLOCK_CHAOS_UPDATE_DOCS=1`` a complete table is also written to
    docs/chaos.md; a plain test run (CI) never changes the working tree.
    """
    table = report.rows()
    if not table:
        return
    terminalreporter.section("chaos summary")
    for line in report.render(table).splitlines():
        terminalreporter.write_line(line)
    stamp = f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
    if os.environ.get("REDLOCK_CHAOS_UPDATE_DOCS") == "1" and report.update_doc(table, stamp):
        terminalreporter.write_line(f"(written to {Path(report.DOC).name})")
