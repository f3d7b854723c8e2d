"""The demo (``scripts/demo``) end to end, on a private redis-server.

It runs the same driver ``scripts/demo`` execs, with the same interpreter as
the tests (the project's venv under ``scripts/test``), and with ``REDIS_URL``
naming the test's own server, so the shared Redis is never touched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_demo_runs_end_to_end_and_cleans_up(redis_server):
    """The demo passes every check, on the given server, and leaves no keys.

    Its summary shows each scenario's numbers: skips, requeues, per-queue locking
    by configuration and by worker option, the refused stale write, and what
    ``apply_async`` did with each call in every lock window.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEMO_")}
    env["REDIS_URL"] = redis_server.url
    # The timeout is a window for a hung demo, far above its usual 20 s.
    proc = subprocess.run(
        [sys.executable, "-m", "example_project.demo"],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr}"

    assert f"redis://127.0.0.1:{redis_server.port}/12" in out
    # Summary rows: task, on conflict, sent, ran, skipped, requeues, took, locked by.
    secs = r"\d+\.\d s"
    rows = {
        r"sync_invoices\(42\)": rf"skip\s+20\s+1\s+19\s+0\s+{secs}\s+SingletonTask",
        r"rebuild_report\(7\)": rf"requeue\s+5\s+5\s+0\s+\d+\s+{secs}\s+SingletonTask",
        r"charge_card\(99, \.\.\.\)": rf"requeue\s+2\s+2\s+0\s+\d+\s+{secs}\s+SingletonTask",
        r"export_statement\(7\)": rf"requeue\s+5\s+5\s+0\s+[1-9]\d*\s+{secs}\s+redlock_queues",
        r"send_reminder\(42\)": rf"skip\s+10\s+1\s+9\s+0\s+{secs}\s+--redlock-queues",
        r"nightly_report\(2026-11-28\)": rf"skip\s+20\s+1\s+0\s+0\s+{secs}\s+SingletonTask",
        r"refresh_rates\(EUR\)": rf"skip\s+11\s+2\s+0\s+0\s+{secs}\s+SingletonTask",
        r"sync_catalog\(5\)": rf"requeue\s+20\s+2\s+0\s+[1-9]\d*\s+{secs}\s+SingletonTask",
        r"all": rf"93\s+19\s+28\s+\d+\s+{secs}",
    }
    for task, rest in rows.items():
        assert re.search(rf"^  {task}\s+{rest}$", out, re.M), f"no summary row {task}\n{out}"

    # Lock windows: task, lock_mode, on duplicate, sent, published, same id,
    # DuplicateTask, ran, skipped, requeues, took.
    windows = {
        r"sync_invoices\(42\)": r"while_executing\s+-\s+20\s+20\s+0\s+0\s+1\s+19\s+0",
        r"nightly_report\(2026-11-28\)": r"until_executed\s+return_existing\s+20\s+1\s+19\s+0\s+1"
        r"\s+0\s+0",
        r"refresh_rates\(EUR\)": r"until_executing\s+raise\s+11\s+2\s+0\s+9\s+2\s+0\s+0",
        r"sync_catalog\(5\)": r"until_and_while_executing\s+return_existing\s+20\s+2\s+18\s+0"
        r"\s+2\s+0\s+[1-9]\d*",
    }
    for task, rest in windows.items():
        row = rf"^  {task}\s+{rest}\s+{secs}$"
        assert re.search(row, out, re.M), f"no lock-window row {task}\n{out}"
    storm = r"^  sync_catalog\(5\): 20 calls; at most 1 running and 1 queued in \d+ samples"
    assert re.search(storm, out, re.M), out
    raised = r"^  refresh_rates\(EUR\): 9 requests raised DuplicateTask naming \w{8}, "
    assert re.search(raised, out, re.M), out
    # The until_executing refresh runs without a lock: its two runs show no fence.
    unfenced = r"^  refresh_rates\(EUR\)\s+\w{8}\s+\d+\s+\+[\d.]+\s+\+[\d.]+\s+-$"
    assert len(re.findall(unfenced, out, re.M)) == 2, out
    assert re.search(r"^  stale holder wakes\s+fence \d+\s+accepted=False", out, re.M), out
    assert "ledger balance of account 99: 65" in out
    assert "--redlock-queues=invoice-demo-reminders" in out
    checks = re.findall(r"^  (ok  |FAIL)  ", out, re.M)
    assert checks == ["ok  "] * 21, out
    locks = r"^  ok    the worker locks invoice-demo-exports \(redlock_queues\) and"
    assert re.search(locks, out, re.M), out
    assert re.search(r"^PASS\s+in [\d.]+ s$", out, re.M), out

    for db in (0, 12):
        assert redis_server.client(db=db).dbsize() == 0, f"keys left in db {db}"


def run_demo_script(redis_url: str) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/demo`` itself with ``REDIS_URL`` set; it must end on its own within 60 s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEMO_")}
    env["REDIS_URL"] = redis_url
    return subprocess.run(
        [str(REPO_ROOT / "scripts" / "demo")],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
def test_a_redis_url_that_does_not_answer_is_an_error_not_a_fallback():
    """REDIS_URL naming a port nobody listens on ends the demo, saying so; 6379 is not used."""
    done = run_demo_script("redis://127.0.0.1:1/0")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    fail = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert fail == [
        "FAIL     no Redis: REDIS_URL=redis://127.0.0.1:1/0 does not answer: "
        "Error 111 connecting to 127.0.0.1:1. Connection refused."
    ], output
    assert "6379" not in output
    assert "Worker" not in output and "Traceback" not in output


@pytest.mark.timeout(90)
def test_a_redis_url_redis_py_cannot_read_gives_one_line():
    """REDIS_URL=nonsense://x ends the demo with one line naming the URL, not a traceback."""
    done = run_demo_script("nonsense://x")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    fail = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 1, output
    assert fail[0].startswith("FAIL     no Redis: REDIS_URL=nonsense://x is not a Redis URL: ")
    assert "Traceback" not in output
