"""The ``celery`` program with celery-redlock: a bad setting at worker start.

Each test runs the real program in a subprocess (``python -m celery -A
tests.celery_apps.cli_app ...``), as an operator would, against a private
redis-server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.redis_servers import RedisServer

REPO = Path(__file__).resolve().parents[2]
APP = "tests.celery_apps.cli_app"


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
