"""The dashboard's parts that need no server: cursors, filters, chart, rates, authentication."""

from __future__ import annotations

import pytest

from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.ops.web.activity import MINUTES, per_minute
from celery_redlock.ops.web.chart import line_chart, nice_ceiling
from celery_redlock.ops.web.command import is_loopback
from celery_redlock.ops.web.listing import Cursor
from celery_redlock.ops.web.security import (
    BASIC,
    TOKEN,
    auth_from,
    csrf_token,
    csrf_valid,
    mode_line,
)


def test_cursor_round_trips_and_rejects_garbage():
    """A cursor survives the URL; anything malformed starts from the beginning."""
    cursor = Cursor(1, 2, 12345, 7)
    assert Cursor.decode(cursor.encode()) == cursor
    for bad in (None, "", "1.2.3", "a.b.c.d", "1.2.3.-4", "1.2.3.4.5"):
        assert Cursor.decode(bad) == Cursor()


def test_nice_ceiling_picks_a_round_axis_top():
    """The y axis ends at 1, 2, 2.5 or 5 times a power of ten."""
    assert [nice_ceiling(v) for v in (0, 0.3, 1, 3, 7, 11, 240)] == [1, 0.5, 1, 5, 10, 20, 250]


def test_line_chart_draws_one_polyline_per_series_with_its_total():
    """Each series is a named polyline of one point per value; the legend gives totals."""
    svg = line_chart(
        {"acquired": [0, 2, 4], "skipped": [1, 1, 1]}, title="t<", x_label="x", y_label="y"
    )
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<polyline") == 2
    assert 'data-name="acquired"' in svg and "acquired (6)" in svg and "skipped (3)" in svg
    assert "t&lt;" in svg  # escaped
    points = svg.split('data-name="acquired" points="')[1].split('"')[0].split()
    assert len(points) == 3


def test_per_minute_spreads_each_interval_over_the_minutes_it_covers():
    """Events of an interval count in the minutes it overlaps, in proportion; old ones drop."""
    now = 10_000.0
    reports = {
        "w1": {
            "history": [
                {"start": now - 120, "end": now - 60, "tasks": {"a": {"acquired": 6}}},
                {"start": now - 90, "end": now - 30, "tasks": {"b": {"skipped": 4}}},
                {"start": now - 7200, "end": now - 7140, "tasks": {"a": {"acquired": 99}}},
            ]
        },
        "w2": {"history": [{"start": now - 10, "end": now, "tasks": {"a": {"acquired": 1}}}]},
    }
    series = per_minute(reports, now)
    assert len(series["acquired"]) == MINUTES
    assert series["acquired"][-2] == pytest.approx(6)
    assert series["acquired"][-1] == pytest.approx(1)
    assert series["skipped"][-2] == pytest.approx(2) and series["skipped"][-1] == pytest.approx(2)
    assert sum(series["acquired"]) == pytest.approx(7)
    assert sum(per_minute(reports, now, task="b")["acquired"]) == 0


def test_auth_comes_from_the_environment_first_and_rejects_ambiguity():
    """The environment wins over the settings; two kinds at once, or a bad value, are errors."""
    assert auth_from({}, {}) is None
    auth = auth_from({"redlock_web_token": "s"}, {"REDLOCK_WEB_TOKEN": "e"})
    assert auth is not None and auth.kind == TOKEN and auth.secret == "e"
    basic = auth_from({"redlock_web_basic_auth": "ops:pw"}, {})
    assert basic is not None and basic.kind == BASIC and basic.source == "redlock_web_basic_auth"
    with pytest.raises(ConfigurationError, match="choose one"):
        auth_from({"redlock_web_token": "t"}, {"REDLOCK_WEB_BASIC_AUTH": "a:b"})
    with pytest.raises(ConfigurationError, match="user:password"):
        auth_from({"redlock_web_basic_auth": "nocolon"}, {})
    with pytest.raises(ConfigurationError, match="non-empty") as info:
        auth_from({"redlock_web_token": ""}, {})
    assert "<hidden>" in str(info.value)


def test_token_login_and_csrf_compare_secrets():
    """A session logs in only with the token; a CSRF token must match the session's own."""
    auth = auth_from({"redlock_web_token": "right"}, {})
    assert auth is not None
    session: dict = {}
    assert not auth.accepts_token("wrong") and auth.accepts_token("right")
    assert not auth.logged_in(session)
    auth.log_in(session)
    assert auth.logged_in(session) and "right" not in str(session)
    token = csrf_token(session)
    assert csrf_token(session) == token
    assert csrf_valid(session, token)
    assert not csrf_valid(session, None) and not csrf_valid(session, token + "x")
    assert not csrf_valid({}, token)


def test_mode_line_says_what_the_dashboard_may_do():
    """The page's mode line names read-only and the kind of protection."""
    assert mode_line(True, None) == "read-only: no action can be taken; no authentication"
    auth = auth_from({}, {"REDLOCK_WEB_BASIC_AUTH": "a:b"})
    assert "HTTP basic auth (REDLOCK_WEB_BASIC_AUTH)" in mode_line(False, auth)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("example.org", False),
    ],
)
def test_loopback_addresses(host, loopback):
    """Only loopback addresses count as unreachable from other machines."""
    assert is_loopback(host) is loopback
