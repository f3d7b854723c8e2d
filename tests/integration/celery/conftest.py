"""Fixtures of the worker-level tests: real ``celery worker`` processes on shared services.

Each test gets a key prefix and queue of its own. Its broker, result backend,
locks and execution history live in Redis db 9 under that prefix (RabbitMQ:
under its queue and exchange names). At teardown the workers are stopped by
pid, then exactly the test's keys, queues and exchanges are deleted.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from tests.celery_apps import storm
from tests.celery_harness import (
    BROKERS,
    REDIS_URL,
    Broker,
    CeleryWorker,
    History,
    WorkerError,
    delete_prefixed_keys,
    start_all,
)

APP_MODULE = "tests.celery_apps.storm"


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test or run uses."""
    return f"rlt-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def queue(prefix: str) -> str:
    """The test's default queue."""
    return f"{prefix}.q"


@pytest.fixture
def acks_late() -> bool:
    """Whether the app acks late; a test overrides it with ``parametrize("acks_late", ...)``."""
    return False


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> Broker:
    """The broker: Redis unless the test parametrises ``broker`` indirectly.

    An unreachable broker fails the test: CI starts both, so a skip would hide
    a broken CI.
    """
    broker = BROKERS[getattr(request, "param", "redis")]
    try:
        broker.check()
    except WorkerError as exc:
        pytest.fail(str(exc), pytrace=False)
    return broker


@pytest.fixture
def db9(prefix: str) -> Iterator[redis.Redis]:
    """A client on Redis db 9; at teardown, every key under the test's prefix is deleted."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        yield client
    finally:
        delete_prefixed_keys(client, prefix)
        client.close()


@pytest.fixture
def history(db9: redis.Redis, prefix: str) -> History:
    """The execution records of this test's tasks (deleted with the prefix)."""
    return History(db9, prefix)


@pytest.fixture
def storm_env(broker: Broker, prefix: str, queue: str, acks_late: bool) -> dict[str, str]:
    """The environment that configures ``tests.celery_apps.storm`` for this test."""
    return storm.environment(
        broker=broker.url,
        backend=REDIS_URL,
        lock_url=REDIS_URL,
        prefix=prefix,
        queue=queue,
        acks_late=acks_late,
    )


@pytest.fixture
def storm_app(storm_env: dict[str, str], db9: redis.Redis) -> Iterator[Celery]:
    """The test process's twin of the workers' app: sends tasks and reads their results."""
    app = storm.create_app(storm_env)
    try:
        yield app
    finally:
        app.close()


class WorkerFactory:
    """Starts workers of the storm app for one test and stops them all at its end.

    Args:
        env: The app's environment.
        log_dir: Where worker logs go.
        prefix: The test's prefix; node names derive from it.
        queue: The default queue workers consume.
    """

    def __init__(self, env: dict[str, str], log_dir: Path, prefix: str, queue: str) -> None:
        self.env = env
        self.log_dir = log_dir
        self.prefix = prefix
        self.queue = queue
        self.workers: list[CeleryWorker] = []
        self.queues: set[str] = {queue}

    def create(
        self,
        pool: str,
        concurrency: int = 1,
        *,
        queues: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> CeleryWorker:
        """Describe a worker without starting it; it is stopped at teardown all the same."""
        queues = list(queues or [self.queue])
        self.queues.update(queues)
        worker = CeleryWorker(
            APP_MODULE,
            pool=pool,
            concurrency=concurrency,
            queues=queues,
            nodename=f"{pool}{len(self.workers)}-{self.prefix}@storm",
            log_dir=self.log_dir,
            env=self.env,
            extra_args=extra_args,
        )
        self.workers.append(worker)
        return worker

    def __call__(self, pool: str, concurrency: int = 1, **kwargs: Any) -> CeleryWorker:
        """Start one worker and wait until it is ready."""
        return self.start(self.create(pool, concurrency, **kwargs))[0]

    def start(self, *workers: CeleryWorker, timeout: float = 40) -> tuple[CeleryWorker, ...]:
        """Start ``workers`` together and wait until each is ready."""
        try:
            start_all(workers, timeout)
        except WorkerError as exc:
            pytest.fail(str(exc), pytrace=False)
        return workers

    def trio(self) -> tuple[CeleryWorker, ...]:
        """One worker of each pool on the default queue: prefork -c 2, solo, threads -c 4."""
        return self.start(
            self.create("prefork", 2),
            self.create("solo", 1),
            self.create("threads", 4),
        )

    def stop_all(self) -> None:
        """Stop every worker this factory created, all at once."""
        for worker in self.workers:
            worker.request_stop()
        for worker in self.workers:
            worker.stop()


@pytest.fixture
def worker_factory(
    storm_env: dict[str, str],
    storm_app: Celery,
    history: History,
    broker: Broker,
    prefix: str,
    queue: str,
    tmp_path: Path,
) -> Iterator[WorkerFactory]:
    """Start workers with ``worker_factory(pool, concurrency)`` or ``.trio()``.

    Teardown stops them (SIGTERM, then SIGKILL by pid) before the keys and
    broker objects of the test are deleted.
    """
    factory = WorkerFactory(storm_env, tmp_path / "workers", prefix, queue)
    try:
        yield factory
    finally:
        factory.stop_all()
        control = f"{prefix}.ctl"
        queues = sorted(factory.queues)
        # Celery's default exchange of a queue is named after it.
        broker.cleanup(queues, [*queues, f"{control}.pidbox", f"reply.{control}.pidbox"])
