"""Choosing the redis-server binary for the test servers."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.redis_servers import BINARY_ENV, RedisServerError, find_redis_server_binary


def test_environment_variable_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An executable named by REDLOCK_TEST_REDIS_SERVER is used before anything on PATH."""
    fake = tmp_path / "my-redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(BINARY_ENV, str(fake))

    assert find_redis_server_binary() == str(fake)


def test_environment_variable_pointing_nowhere_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong REDLOCK_TEST_REDIS_SERVER fails loudly instead of falling back to another binary."""
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "missing"))

    with pytest.raises(RedisServerError, match=BINARY_ENV):
        find_redis_server_binary()


def test_path_is_searched_without_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the variable, the redis-server found on PATH is chosen."""
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.delenv(BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")

    assert find_redis_server_binary() == str(fake)
