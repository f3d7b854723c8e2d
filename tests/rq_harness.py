"""Real ``rq worker`` subprocesses for the RQ integration tests.

Workers run the repository's ``tests.rq_apps`` jobs against the test's private
redis-server, log to files under the test's tmp_path, and are stopped by their
own pid (SIGTERM, the warm shutdown; SIGKILL only if that hangs) when their
``rq_workers`` block ends, however it ends.

Tests wait for their jobs' outcomes, never for a burst worker to exit: with
redis-py >= 8.2 a worker's teardown joins its pubsub thread, which may sit out
the rest of its 60 s poll (RQ 2.x and 3.0 alike), so a burst worker can linger
for up to a minute after its last job. The workers run
:class:`tests.rq_apps.worker.PromptStopWorker`, which stops that thread before
unsubscribing, so that a stop does not wait it out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

from rq.job import Job, JobStatus

ROOT = Path(__file__).resolve().parent.parent
#: The statuses in which a job has ended: nothing runs it again unless it is requeued.
ENDED = frozenset({JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED})


def rq_command() -> list[str]:
    """How to run the ``rq`` command line of this interpreter's environment."""
    return [sys.executable, "-m", "rq.cli"]


class RQWorker:
    """One ``rq worker`` process; ``env`` adds variables to the test's environment."""

    def __init__(
        self,
        url: str,
        queue: str,
        logdir: Path,
        *,
        name: str,
        burst: bool = False,
        scheduler: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        argv = [*rq_command(), "worker", "--url", url, "--name", name, "--path", str(ROOT)]
        argv += ["--worker-class", "tests.rq_apps.worker.PromptStopWorker"]
        if burst:
            argv.append("--burst")
        if scheduler:
            argv.append("--with-scheduler")
        argv.append(queue)
        logdir.mkdir(parents=True, exist_ok=True)
        self.log_path = logdir / f"{name}.log"
        env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the worker by its pid: SIGTERM, then SIGKILL if it does not exit in time."""
        if self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def log(self) -> str:
        """The worker's output so far, for failure messages."""
        return self.log_path.read_text(errors="replace")[-4000:]


@contextmanager
def rq_workers(
    url: str, queue: str, logdir: Path, count: int, **kwargs
) -> Iterator[list[RQWorker]]:
    """Start ``count`` workers on ``queue``; stop every one started when the block ends.

    Each stop is registered as its worker starts, so a failed start, a failed
    test or a stop that raises still stops (and reaps) the others.
    """
    with ExitStack() as stops:
        workers: list[RQWorker] = []
        for i in range(count):
            worker = RQWorker(url, queue, logdir, name=f"{queue}-w{i}", **kwargs)
            stops.callback(worker.stop)
            workers.append(worker)
        yield workers


def wait_for_jobs(
    jobs: Iterable[Job],
    timeout: float,
    workers: Iterable[RQWorker] = (),
    status: JobStatus | None = None,
) -> None:
    """Wait until every job has ended (or, given ``status``, is in it).

    Fails naming the jobs still out, with the workers' logs.
    """
    jobs = list(jobs)

    def pending() -> list[Job]:
        return [
            job
            for job in jobs
            if (job.get_status() != status if status is not None else job.get_status() not in ENDED)
        ]

    try:
        wait_until(lambda: not pending(), timeout, f"{len(jobs)} jobs to end")
    except AssertionError as exc:
        out = ", ".join(f"{job.id} ({job.get_status()})" for job in pending())
        logs = "\n".join(worker.log() for worker in workers)
        raise AssertionError(f"{exc}; still out: {out}\n{logs}") from None


def wait_until(condition, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``condition`` until it is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
