"""pid_alive: what stale-lock recovery and the reaper take for a dead holder."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from celery_redlock.core.recovery import pid_alive


def test_a_running_process_is_alive():
    assert pid_alive(os.getpid())


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="zombies are read from /proc")
def test_an_exited_process_not_yet_reaped_is_dead():
    """A killed pool process stays a zombie until reaped; it holds nothing any more."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        state = b""
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
            if state == b"Z":
                break
            time.sleep(0.01)
        assert state == b"Z"  # exited, not waited for: a zombie
        assert not pid_alive(child.pid)
    finally:
        child.wait()
    assert not pid_alive(child.pid)


def test_impossible_pids_are_dead():
    assert not pid_alive(0)
    assert not pid_alive(-5)
