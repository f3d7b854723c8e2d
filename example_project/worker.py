"""A ``celery worker`` subprocess for the demo: started, watched, and stopped by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """``celery -A example_project.celery_app worker`` with a prefork pool.

    It runs in a session of its own, so a Ctrl-C in the terminal reaches only
    the driver, which then shuts the worker down in order.

    Args:
        env: Variables added to the driver's environment (``DEMO_REDIS_URL``, ...).
        args: Further worker arguments: the queues (``-Q``) and ``--redlock-queues``.
        log_path: Where its output goes.
        concurrency: Pool processes.
    """

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        args: Sequence[str],
        log_path: Path,
        concurrency: int = 4,
    ) -> None:
        self.env = dict(env)
        self.args = list(args)
        self.log_path = log_path
        self.concurrency = concurrency
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        """The worker's command line."""
        return [
            sys.executable, "-m", "celery", "-A", "example_project.celery_app", "worker",
            "-P", "prefork", "-c", str(self.concurrency), *self.args,
            "-n", f"invoice-demo-{os.getpid()}@%h",
            "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "INFO",
        ]  # fmt: skip

    @property
    def pid(self) -> int | None:
        """The main process's pid, once started."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Spawn the worker; readiness is the caller's to wait for."""
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def exit_code(self) -> int | None:
        """The exit code once the main process has ended, else ``None``."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout: float = 10.0) -> None:
        """Warm shutdown with SIGTERM; SIGKILL after ``timeout`` seconds.

        After a SIGKILL the pool processes are killed too, through the process
        group that :meth:`start` created (its id is the worker's pid).
        """
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the worker's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no output)"
        return "\n".join(text.splitlines()[-lines:])
