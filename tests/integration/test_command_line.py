"""The ``celery`` program with celery-redlock: ``redlock purge`` and a bad setting at worker start.

Each test runs the real program in a subprocess (``python -m celery -A
tests.celery_apps.cli_app ...``), as an operator would, against a private
redis-server, and answers its questions on stdin.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_redlock import Lock
from celery_redlock.core.holder import Holder
from celery_redlock.core.keys import KeyBuilder
from tests.processes import dead_pid
from tests.redis_servers import RedisServer

REPO = Path(__file__).resolve().parents[2]
APP = "tests.celery_apps.cli_app"
#: The app's SingletonTask (importing the app module would build the app here).
TASK_NAME = "cli.sync"
PROMPT = "lock(s)? [y/N]:"


def run_celery(
    server: RedisServer, prefix: str, *args: str, answer: str | None = None, **settings: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A tests.celery_apps.cli_app <args>``; it must end within 60 s."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "REDLOCK_TEST_BROKER": server.url,
        "REDLOCK_TEST_LOCK_URL": server.url,
        "REDLOCK_TEST_PREFIX": prefix,
        "REDLOCK_TEST_SETTINGS": json.dumps(settings),
    }
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, *args],
        env=env,
        cwd=REPO,
        input=answer,
        stdin=None if answer is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own."""
    return f"cli-{uuid.uuid4().hex[:8]}"


def hold(server: RedisServer, prefix: str, account: int) -> str:
    """Take the task lock of ``sync(account)`` as a worker would, and leave it held; its key."""
    key = KeyBuilder(TASK_NAME, lambda account: account, None, prefix).key_for((account,), {})
    holder = Holder.new(f"task-{account}", "worker1@test", ttl=60)
    lock = Lock(server.client(), key, timeout=60, auto_renew=False)
    assert lock.acquire(blocking=False, token=holder.encode())
    return key


def test_purge_lists_what_it_would_delete_then_asks_and_a_no_deletes_nothing(redis_server, prefix):
    """Declined: the locks are listed as "would delete" before the question, and all remain."""
    keys = [hold(redis_server, prefix, account) for account in (1, 2)]
    values = {key: redis_server.client().get(key) for key in keys}
    done = run_celery(redis_server, prefix, "redlock", "purge", "--all", answer="n\n")
    assert done.returncode == 1, done.stderr
    out = done.stdout
    asked = out.index(PROMPT)
    for key in keys:
        assert f"would delete {key} (held by task-" in out[:asked]
    assert "deleting" not in out and "deleted" not in out
    assert "Aborted!" in done.stderr
    assert {key: redis_server.client().get(key) for key in keys} == values


def test_purge_deletes_after_a_yes(redis_server, prefix):
    """Accepted: the listed locks are deleted, and the count says so."""
    keys = [hold(redis_server, prefix, account) for account in (1, 2)]
    done = run_celery(redis_server, prefix, "redlock", "purge", "--all", answer="y\n")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    asked = out.index(PROMPT)
    assert all(f"would delete {key}" in out[:asked] for key in keys)
    assert out.rstrip().endswith("deleted 2 lock(s)")
    assert not any(redis_server.client().exists(key) for key in keys)


def test_purge_yes_does_not_ask_and_names_what_it_deleted(redis_server, prefix):
    """--yes: no question; each lock is named as it is deleted."""
    key = hold(redis_server, prefix, 3)
    done = run_celery(redis_server, prefix, "redlock", "purge", "--task", TASK_NAME, "--yes")
    assert done.returncode == 0, done.stderr
    assert PROMPT not in done.stdout
    deleted, total = done.stdout.splitlines()
    assert re.fullmatch(
        rf"deleted {re.escape(key)} \(held by task-3 on worker1@test, ttl [\d.]+s\)", deleted
    )
    assert total == "deleted 1 lock(s)"
    assert not redis_server.client().exists(key)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        # Met while the app is loaded: the SingletonTask is bound to the app.
        ({"redlock_ttl": -1}, "redlock_ttl=-1: must be a positive number of seconds"),
        # Met by the worker's bootstep, once the app is loaded.
        ({"redlock_stats": "yes"}, "redlock_stats='yes': must be True or False"),
    ],
)
def test_a_bad_setting_stops_the_worker_with_one_line(redis_server, prefix, settings, expected):
    """`celery worker` exits non-zero with one line naming the setting, and no traceback."""
    done = run_celery(redis_server, prefix, "worker", "-P", "solo", **settings)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "Traceback" not in output
    mentions = [line for line in output.splitlines() if next(iter(settings)) in line]
    assert mentions == [f"celery-redlock: configuration error: {expected}"], output
    if "redlock_ttl" in settings:  # nothing else ran before the app was loaded
        assert output.strip() == mentions[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"redlock_ttl": -1}, "redlock_ttl=-1: must be a positive number of seconds"),
        ({"redlock_stats": "yes"}, "redlock_stats='yes': must be True or False"),
    ],
)
def test_with_debug_logging_the_traceback_is_shown(redis_server, prefix, settings, expected):
    """`-l DEBUG` keeps the traceback of the configuration error, wherever it is met."""
    done = run_celery(redis_server, prefix, "worker", "-P", "solo", "-l", "DEBUG", **settings)
    assert done.returncode != 0
    assert "Traceback (most recent call last)" in done.stderr
    assert done.stderr.rstrip().endswith(f"ConfigurationError: {expected}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("settings", "options", "expected"),
    [
        (
            {"redlock_reaper_interval": "abc"},
            (),
            "redlock_reaper_interval='abc': must be a positive number of seconds",
        ),
        (
            {},
            ("--redlock-metrics-port", "70000"),
            "--redlock-metrics-port=70000: must be a port number from 0 to 65535",
        ),
    ],
)
def test_a_bad_operations_setting_stops_the_worker_before_it_touches_the_store(
    redis_server, prefix, settings, options, expected
):
    """The reaper's and metrics' settings are refused before stale-lock recovery releases anything.

    A worker that is going to refuse to start must leave the lock store as it
    found it: here a lock its dead earlier run left, which recovery would release.
    """
    node = f"worker-{prefix}@{Holder.new('x').host}"
    key = KeyBuilder(TASK_NAME, lambda account: account, None, prefix).key_for((5,), {})
    base = Holder.new("dead-task", node, ttl=60)
    stale = Holder(**{**base.__dict__, "pid": dead_pid()}).encode()
    redis_server.client().set(key, stale, px=60_000)
    done = run_celery(
        redis_server, prefix, "worker", "-P", "solo", "-n", node, *options, **settings
    )
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert f"celery-redlock: configuration error: {expected}" in output.splitlines(), output
    assert redis_server.client().get(key) == stale.encode()


@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_a_timeout_that_waits_for_no_reply_is_refused(redis_server, prefix, timeout):
    """`release --timeout 0` would read a live holder's worker as gone: a usage error instead.

    Nothing is released: the holder, on a host this machine cannot check,
    would otherwise be judged by a ping given no time to answer.
    """
    key = KeyBuilder(TASK_NAME, lambda account: account, None, prefix).key_for((6,), {})
    base = Holder.new("far-task", "worker1@far-away", ttl=60)
    far = Holder(**{**base.__dict__, "host": "far-away"}).encode()
    redis_server.client().set(key, far, px=60_000)
    for command in (("release", key), ("stats",)):
        done = run_celery(redis_server, prefix, "redlock", *command, "--timeout", timeout)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "Invalid value for '--timeout'" in done.stderr, done.stderr
    assert redis_server.client().get(key) == far.encode()


@pytest.mark.parametrize("command", [("list",), ("purge", "--yes")])
def test_a_task_name_the_app_does_not_have_is_pointed_out(redis_server, prefix, command):
    """`--task cli.synk` finds nothing, and says the app has no such task but has cli.sync."""
    key = hold(redis_server, prefix, 7)
    done = run_celery(redis_server, prefix, "redlock", *command, "--task", "cli.synk")
    assert done.returncode == 0, done.stderr
    nothing = "no locks held" if command[0] == "list" else "no locks to delete"
    hint = "(cli.synk is not a task of this app; did you mean cli.sync?)"
    assert done.stdout.strip() == f"{nothing} {hint}"
    assert redis_server.client().exists(key)
