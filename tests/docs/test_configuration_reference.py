"""docs/configuration.md documents every setting and task option the code reads.

The lists come from the code, never from this file: the settings are
``settings.SETTINGS`` plus every ``redlock_*`` string literal in the package
(scanned with ``ast``), the task options are ``lock_<name>`` for each entry of
``options.OPTIONS`` plus every ``lock_*`` attribute ``SingletonTask`` declares.
A new setting or option therefore fails this test until it is documented.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import celery_redlock
from celery_redlock.calls import options
from celery_redlock.celery import settings
from celery_redlock.celery.install import worker_option
from celery_redlock.celery.task import SingletonTask

PACKAGE = Path(celery_redlock.__file__).resolve().parent
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SETTING_NAME = re.compile(r"redlock_[a-z0-9_]+")


def setting_literals() -> set[str]:
    """Every string constant in the package that is, in full, a ``redlock_*`` name."""
    found: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and SETTING_NAME.fullmatch(node.value)
            ):
                found.add(node.value)
    return found


def settings_read() -> set[str]:
    return set(settings.SETTINGS) | setting_literals()


def task_options() -> set[str]:
    from_conf = {f"lock_{name}" for name in options.OPTIONS}
    declared = {
        name
        for name, value in vars(SingletonTask).items()
        if name.startswith("lock_") and not callable(value) and not isinstance(value, classmethod)
    }
    return from_conf | declared


def documented(name: str) -> bool:
    return f"`{name}`" in REFERENCE.read_text()


def test_the_scan_finds_the_known_settings():
    """The scan sees the settings read by literal name, so an empty scan cannot pass silently."""
    assert {"redlock_url", "redlock_queues"} <= setting_literals()
    assert {"redlock_ttl", "redlock_on_conflict"} <= settings_read()
    assert {"lock_ttl", "lock_key", "lock_on_conflict"} <= task_options()


def test_every_setting_read_is_a_known_setting():
    """A ``redlock_*`` name used in the code is in settings.SETTINGS, which validation accepts."""
    assert setting_literals() <= set(settings.SETTINGS)


@pytest.mark.parametrize("name", sorted(settings_read()))
def test_setting_is_documented(name):
    """Each ``redlock_*`` setting appears, as code, in the configuration reference."""
    assert documented(name), f"{name} is missing from {REFERENCE.name}"


@pytest.mark.parametrize("name", sorted(task_options()))
def test_task_option_is_documented(name):
    """Each ``lock_*`` task option appears, as code, in the configuration reference."""
    assert documented(name), f"{name} is missing from {REFERENCE.name}"


def test_worker_option_is_documented():
    """The ``--redlock-queues`` worker option appears in the configuration reference."""
    for flag in worker_option().opts:
        assert documented(flag), flag


def _shown(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


@pytest.mark.parametrize("name", sorted(options.OPTIONS))
def test_summary_row_shows_the_default(name):
    """The summary table's row of each option shows the default that LockOptions uses."""
    default = getattr(options.LockOptions(), name)
    rows = [
        line
        for line in REFERENCE.read_text().splitlines()
        if line.startswith("| [`lock_") and f"[`lock_{name}`]" in line
    ]
    assert len(rows) == 1, f"no single summary row for lock_{name}"
    default_cell = rows[0].split("|")[-2]
    assert _shown(default) in default_cell, f"lock_{name}: {_shown(default)} not in {rows[0]}"
