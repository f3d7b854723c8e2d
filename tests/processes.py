"""Processes for tests that judge lock holders by their pid."""

from __future__ import annotations

import subprocess
import sys


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped): a holder known to be gone."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
