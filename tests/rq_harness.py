"""Real ``rq worker`` subprocesses for the RQ integration tests.

Workers run the repository's ``tests.rq_apps`` jobs against the test's private
redis-server, log to files under the test's tmp_path, and are stopped by their
own pid (SIGTERM, the warm shutdown; SIGKILL only if that hangs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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

    def wait(self, timeout: float) -> int:
        """Wait for a burst worker to exit; return its exit status."""
        return self.process.wait(timeout=timeout)

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
    """Start ``count`` workers on ``queue``; stop them all when the block ends."""
    workers: list[RQWorker] = []
    try:
        for i in range(count):
            workers.append(RQWorker(url, queue, logdir, name=f"{queue}-w{i}", **kwargs))
        yield workers
    finally:
        for worker in workers:
            worker.stop()


def wait_until(condition, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``condition`` until it is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
