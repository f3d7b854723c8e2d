"""The operator's view of rate keys: ``celery redlock list`` and ``show`` tell used/limit,
the time until a slot frees and a back-off, whoever set the rate (here the decorator)."""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_redlock import back_off, singleton
from celery_redlock.ops.cli import redlock

pytestmark = pytest.mark.timeout(60)


def invoke(app: Celery, *args: str) -> Result:
    """Run ``celery redlock <args>`` in this process against ``app``."""
    return CliRunner().invoke(
        redlock, list(args), obj=CLIContext(app=app, no_color=True, workdir=None)
    )


def test_list_and_show_tell_a_rate_keys_use_and_when_a_slot_frees(
    storm_app: Celery, db9: redis.Redis, prefix: str
) -> None:
    """Two starts of a 3/m rate key on one account, three (full) and a back-off on another:
    list shows 2/3 and 3/3 with the wait, show gives the lines, --json the numbers."""

    @singleton(client=db9, rate="3/m", rate_key="account", key_prefix=prefix, name="view.api")
    def call(account: str, pause: bool = False) -> None:
        if pause:
            back_off(30)

    call("a")
    call("a")
    for _ in range(3):
        call("b")
    call("c", pause=True)
    listed = json.loads(invoke(storm_app, "list", "--json").output)
    rates = sorted((e for e in listed if e.get("kind") == "rate"), key=lambda e: e["used"])
    assert [(e["task"], e["used"], e["limit"], e["window"]) for e in rates] == [
        ("view.api", 1, 3, 60.0),
        ("view.api", 2, 3, 60.0),
        ("view.api", 3, 3, 60.0),
    ]
    assert rates[1]["wait"] == 0 and 55 < rates[2]["wait"] <= 60
    assert 25 < rates[0]["backed_off"] <= 30
    text = invoke(storm_app, "list").output
    assert "USED/LIMIT" in text and "3 rate key(s)" in text
    assert "2/3" in text and "3/3" in text and "60s" in text
    full = rates[2]["key"]
    shown = invoke(storm_app, "show", full)
    assert shown.exit_code == 0, shown.output
    assert "rate key" in shown.output and "3/3 starts in the last 60s" in shown.output
    assert json.loads(invoke(storm_app, "show", full, "--json").output)["used"] == 3
    only = json.loads(invoke(storm_app, "list", "--json", "--task", "view.other").output)
    assert only == []
