"""The quickstart, followed by a newcomer in a new virtualenv, from a clone of the working tree.

Nothing here is copied from docs/quickstart.md: the install command, the app
(``proj.py``) and the worker command are read from the page, so the page
cannot drift from what works. The test

1. copies the working tree (tracked and untracked files, not the ignored ones)
   to ``<tmp>/celery-redlock``, as a clone would be;
2. creates a virtualenv without the system's site-packages and runs the
   quickstart's install command in ``<tmp>``, with that virtualenv first on
   ``PATH`` (pip uses the machine's usual index);
3. saves ``proj.py`` in ``<tmp>/project``, its Redis pointed at a private
   ``redis-server``, and starts the quickstart's worker command (prefork, ``-c 2``);
4. sends 20 identical calls and reads every result with ``get(timeout=5)``;
5. reads ``celery redlock stats``;
6. kills the worker (``kill -9``, its pool processes too) while a task holds
   its lock, restarts the same command (the same node name), and checks that
   the dead run's lock is gone once the new worker is ready.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.docs.examples import (
    REPO_ROOT,
    Address,
    Background,
    Block,
    console_commands,
    examples,
)

FRESH_VENV_TEST = "tests/quickstart/test_fresh_venv.py::test_quickstart_in_a_fresh_virtualenv"

QUICKSTART = "docs/quickstart.md"
CALLS = 20
RESULT = "prices of store 1 refreshed"
READY = re.compile(r"(?P<node>\S+@\S+) ready\.")

# Run with the new virtualenv's interpreter, in the project directory: the
# quickstart's calls, with each outcome recorded instead of printed.
CLIENT = """
import json

from celery_redlock import DuplicateSkipped
from proj import refresh_prices

results = [refresh_prices.delay(1) for _ in range(%(calls)d)]
outcomes = []
for result in results:
    outcome = {"id": result.id}
    try:
        outcome["value"] = result.get(timeout=5)
    except DuplicateSkipped as skipped:
        outcome.update(
            skipped=str(skipped), holder=skipped.holder, key=skipped.lock_name,
            state=result.state, info=result.info,
        )
    except Exception as exc:
        outcome["error"] = repr(exc)
    outcomes.append(outcome)
print(json.dumps(outcomes))
"""

# The package comes from the new virtualenv, and kombu's Redis transport imports.
WHERE = "import celery_redlock, kombu.transport.redis; print(celery_redlock.__file__)"

HOLD = """
import json

from proj import refresh_prices

result = refresh_prices.delay(2)
print(json.dumps({"id": result.id, "key": refresh_prices.lock_key_for(2)}))
"""


def quickstart() -> tuple[str, Block, str]:
    """The quickstart's install command, its ``proj.py`` block and its first worker command."""
    blocks = examples(QUICKSTART)
    commands = [c for b in blocks if b.kind == "console" for c in console_commands(b)]
    installs = [c.command for c in commands if "pip install" in c.command]
    apps = [b for b in blocks if b.filename == "proj.py"]
    workers = [c.command for c in commands if c.is_worker]
    assert len(installs) == 1, f"{QUICKSTART}: one install command expected, found {installs}"
    assert len(apps) == 1, f"{QUICKSTART}: one proj.py block expected"
    assert workers, f"{QUICKSTART}: no worker command"
    return installs[0], apps[0], workers[0]


def copy_working_tree(destination: Path) -> None:
    """Copy what a clone of the working tree holds: tracked and untracked, not ignored, files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO_ROOT / name
        if not source.is_file():  # deleted in the working tree, not yet in the index
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def venv_env(venv: Path, **extra: str) -> dict[str, str]:
    """The environment of a shell with ``venv`` activated: nothing of the test's own interpreter."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CELERY_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(command: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Run ``command``; return its output, or fail the test with it."""
    done = subprocess.run(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{command} exited with {done.returncode}:\n{done.stdout}"
    return done.stdout


def stats_row(output: str, task: str) -> dict[str, str] | None:
    """The counters of ``task`` in ``celery redlock stats`` output, by column name."""
    lines = output.splitlines()
    header = next((line.split() for line in lines if line.startswith("TASK")), None)
    row = next((line.split() for line in lines if line.split()[:1] == [task]), None)
    if header is None or row is None:
        return None
    return dict(zip(header, row))


def wait_ready(worker: Background) -> str:
    """Wait until ``worker`` is ready; return its node name."""
    worker.wait_for(READY, timeout=90)
    found = READY.search(worker.log())
    assert found is not None
    return found["node"]


def wait_for_lock(client: redis.Redis, key: str, task_id: str, timeout: float) -> str:
    """Wait until ``key`` holds a lock of task ``task_id``; return its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = client.get(key)
        if value and task_id in value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"task {task_id} never held {key} (it holds {value!r})")
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
def test_quickstart_in_a_fresh_virtualenv(redis_server, tmp_path):
    """Installed as the quickstart says, its app skips 19 of 20 calls, counts them, recovers a lock.

    Every ``get()`` ends within 5 s; the 19 skipped calls raise
    ``DuplicateSkipped`` naming the call that ran; ``celery redlock stats``
    shows 1 acquired and 19 skipped; the lock of a worker killed mid-task is
    gone once the same worker, restarted, is ready.
    """
    install, app_block, worker_command = quickstart()
    words = shlex.split(worker_command, comments=True)
    assert "-c 2" in shlex.join(words), f"the quickstart's worker is not -c 2: {worker_command}"
    assert "-P" not in words or "-P prefork" in shlex.join(words), worker_command

    clone = tmp_path / "celery-redlock"
    copy_working_tree(clone)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=dict(os.environ), timeout=300)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    env = venv_env(venv)
    run(["bash", "-c", install], cwd=tmp_path, env=env, timeout=600)
    python = str(venv / "bin" / "python")
    where = run([python, "-c", WHERE], cwd=tmp_path, env=env, timeout=60)
    assert where.strip().startswith(str(venv)), f"celery_redlock imported from {where}"

    project = tmp_path / "project"
    project.mkdir()
    address = Address(redis_server.port)
    (project / "proj.py").write_text(address.rewrite(app_block.code))
    env = venv_env(venv, PYTHONPATH=str(project))
    argv = ["bash", "-c", f"exec {address.rewrite(worker_command)}"]
    client = redis_server.client(decode_responses=True)
    workers: list[Background] = []

    def start_worker(number: int) -> tuple[Background, str]:
        worker = Background(argv, cwd=project, env=env, log_path=tmp_path / f"worker-{number}.log")
        workers.append(worker.start())
        return worker, wait_ready(worker)

    try:
        worker, node = start_worker(1)

        # Twenty identical calls: one runs, nineteen are skipped, every get() ends within 5 s.
        outcomes = json.loads(
            run([python, "-c", CLIENT % {"calls": CALLS}], cwd=project, env=env, timeout=120)
        )
        assert len(outcomes) == CALLS
        errors = [o for o in outcomes if "error" in o]
        assert not errors, f"get(timeout=5) did not end as it should: {errors}"
        ran = [o for o in outcomes if "value" in o]
        skipped = [o for o in outcomes if "skipped" in o]
        assert [o["value"] for o in ran] == [RESULT], outcomes
        holder = ran[0]["id"]
        assert len(skipped) == CALLS - 1
        for outcome in skipped:
            assert outcome["state"] == "SKIPPED", outcome
            assert outcome["holder"] == holder, outcome
            assert outcome["info"]["holder"] == holder, outcome
            assert outcome["info"]["holder_hostname"] == node, outcome
            assert holder in outcome["skipped"] and outcome["key"] in outcome["skipped"], outcome
        assert len({o["key"] for o in skipped}) == 1

        # The worker counted them.
        stats = run(
            ["bash", "-c", "exec celery -A proj redlock stats"], cwd=project, env=env, timeout=60
        )
        row = stats_row(stats, "proj.refresh_prices")
        assert row is not None, stats
        assert (row["ACQUIRED"], row["SKIPPED"]) == ("1", str(CALLS - 1)), stats

        # kill -9 while a task holds its lock, then restart under the same node name.
        held = json.loads(run([python, "-c", HOLD], cwd=project, env=env, timeout=60))
        key = held["key"]
        value = wait_for_lock(client, key, held["id"], timeout=30)
        worker.kill()  # the main process and its pool processes, all by pid
        assert client.get(key) == value, "the task ended before the kill: its lock is gone"
        # Until init reaps them, the killed processes are zombies, and recovery
        # takes a listed pid for a live one (erring on the safe side).
        worker.wait_gone(timeout=60)
        # Only recovery, not expiry, may remove it before the new worker is ready,
        # however slowly this machine restarts it.
        client.pexpire(key, 300_000)

        restarted, restarted_node = start_worker(2)
        assert restarted_node == node
        assert client.get(key) is None, f"{key} is still there\n{restarted.log_tail()}"
        assert f"released stale lock {key}" in restarted.log(), restarted.log_tail()
    finally:
        for started in workers:
            started.stop()


@pytest.mark.timeout(180)
def test_ci_and_scripts_test_run_the_fresh_venv_test():
    """CI runs scripts/test, which runs pytest with no marker filter: the slow test above runs."""
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec scripts/test\s*$", ci, re.MULTILINE), ci
    runner = (REPO_ROOT / "scripts" / "test").read_text()
    assert re.search(r'^  exec "\$python" -m pytest "\$@"$', runner, re.MULTILINE)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert FRESH_VENV_TEST in collected.stdout.splitlines(), collected.stdout[-2000:]
