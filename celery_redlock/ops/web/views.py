"""The dashboard's pages: locks, one lock, release, stats, metrics and login.

Views only read and present; the work is done by :mod:`.listing`,
:mod:`.detail`, :mod:`.activity` and, for a release, by the same function
as ``celery redlock release`` (:func:`celery_redlock.ops.commands.release_checked`).
A release is a POST answered with a redirect (or, when refused, the
confirmation page again with the reason), never a GET.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlencode

from flask import Flask, Response, flash, redirect, render_template, request, session, url_for
from redis.exceptions import RedisError
from werkzeug.wrappers import Response as BaseResponse

from celery_redlock.celery.stats import COUNTERS
from celery_redlock.core.inventory import RESERVATION_SUFFIX, LockInfo
from celery_redlock.ops.commands import release_checked

from .activity import MINUTES, collect, per_minute
from .chart import line_chart
from .dashboard import dashboard
from .detail import read_copies, read_detail
from .limits import read_limits
from .listing import Cursor, Filters, read_page
from .metrics import metrics_body

__all__ = ["register"]

#: How a refused release says it can be forced, on the dashboard.
FORCE_HINT = "tick 'force' and confirm to release it anyway"


def register(web: Flask) -> None:
    """Add the pages to ``web``."""
    web.add_url_rule("/", "locks", locks)
    web.add_url_rule("/lock", "lock", lock)
    web.add_url_rule("/release", "release", confirm_release, methods=["GET"])
    web.add_url_rule("/release", "do_release", release, methods=["POST"])
    web.add_url_rule("/stats", "stats", stats)
    web.add_url_rule("/metrics", "metrics", metrics)
    web.add_url_rule("/login", "login", login, methods=["GET", "POST"])
    web.add_url_rule("/logout", "logout", logout, methods=["POST"])
    web.add_template_filter(duration, "duration")


def duration(seconds: float | None) -> str:
    """``12.3s``, ``4m 05s``, ``2h 03m``; ``-`` for none."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def _row(info: LockInfo) -> dict[str, Any]:
    holder = info.holder
    acquired = info.acquired_at
    return {
        "key": info.key,
        "kind": info.kind,
        "task": info.task,
        # The arguments' digest: "<prefix>:v1:{<task>:<digest>}", maybe ":queued" after.
        "digest": info.key.removesuffix(RESERVATION_SUFFIX)[:-1].rsplit(":", 1)[-1][:12],
        "task_id": holder.task_id if holder else "?",
        "node": holder.hostname if holder else "?",
        "pid": holder.pid if holder else "?",
        "host": (holder.host or "-") if holder else "?",
        "queue": (holder.queue or "-") if holder else "?",
        "fence": "-" if info.fence is None else info.fence,
        "age": None if acquired is None else max(0.0, info.server_time - acquired),
        "ttl": info.ttl,
        "renewals": "-" if info.renewals is None else info.renewals,
    }


def _refresh() -> float:
    given = request.args.get("refresh")
    try:
        return max(0.0, float(given)) if given is not None else dashboard().refresh
    except ValueError:
        return dashboard().refresh


def locks() -> str:
    """The locks page: one page of locks and reservations, filtered, refreshing itself."""
    dash = dashboard()
    filters = Filters(
        task=request.args.get("task", "").strip(),
        queue=request.args.get("queue", "").strip(),
        text=request.args.get("key", "").strip(),
    )
    cursor = Cursor.decode(request.args.get("cursor"))
    error, rows, next_url, limits = None, [], None, None
    try:
        page = read_page(dash.nodes(), dash.prefixes(), filters, cursor, dash.page_size)
        if cursor == Cursor():  # semaphores and rate keys: on the first page
            limits = read_limits(dash.nodes(), dash.prefixes(), filters, dash.page_size)
    except RedisError as exc:
        error = f"the lock store failed: {exc!r}"
    else:
        rows = sorted((_row(info) for info in page.rows), key=lambda r: (r["task"], r["key"]))
        if page.next is not None:
            query = {"task": filters.task, "queue": filters.queue, "key": filters.text}
            query = {name: value for name, value in query.items() if value}
            next_url = f"{url_for('locks')}?{urlencode({**query, 'cursor': page.next.encode()})}"
    return render_template(
        "locks.html",
        rows=rows,
        filters=filters,
        error=error,
        next_url=next_url,
        first_page=cursor == Cursor(),
        refresh=_refresh(),
        limits=limits,
    )


def lock() -> tuple[str, int] | str:
    """One lock: its holder, the holder's task state and worker, the keys beside it."""
    dash = dashboard()
    key = request.args.get("key", "")
    try:
        detail = read_detail(dash.app, dash.nodes(), key, dash.ping_timeout) if key else None
    except RedisError as exc:
        return render_template("lock.html", key=key, detail=None, error=repr(exc)), 503
    if detail is None:
        return render_template("lock.html", key=key, detail=None, error=None), 404
    return render_template(
        "lock.html",
        key=key,
        detail=detail,
        row=_row(detail.info),
        error=None,
        nodes=len(detail.holders),
    )


def _confirm_page(key: str, message: str | None, status: int) -> tuple[str, int]:
    dash = dashboard()
    detail = read_detail(dash.app, dash.nodes(), key, dash.ping_timeout) if key else None
    row = _row(detail.info) if detail is not None else None
    return render_template("release.html", key=key, detail=detail, row=row, message=message), status


def confirm_release() -> tuple[str, int]:
    """The confirmation step: what was checked about the holder, and the button to go on."""
    if dashboard().read_only:
        return render_template(
            "release.html",
            key="",
            detail=None,
            row=None,
            message="refused: the dashboard runs read-only",
        ), 403
    key = request.args.get("key", "")
    return _confirm_page(key, None, 200 if key else 404)


def release() -> BaseResponse | tuple[str, int]:
    """Release the confirmed lock value, under the CLI's rules; redirect to the locks page."""
    dash = dashboard()
    key, value = request.form.get("key", ""), request.form.get("value", "")
    force = request.form.get("force") == "1"
    current = next((copy for copy in read_copies(dash.nodes(), key) if copy is not None), None)
    if current is None or current.value != value:
        flash(f"{key} changed hands or expired since it was shown; nothing deleted", "warning")
        return redirect(url_for("locks"), 303)
    outcome = release_checked(dash.app, current, force, dash.ping_timeout, FORCE_HINT)
    if outcome.refused:
        return _confirm_page(key, outcome.message, 409)
    flash(outcome.message, "success" if outcome.released else "warning")
    return redirect(url_for("locks"), 303)


def stats() -> str:
    """Counters per task and per worker, and the last hour of them as a chart."""
    dash = dashboard()
    task = request.args.get("task", "").strip() or None
    error = None
    try:
        activity = collect(dash.app, dash.ping_timeout)
    except Exception as exc:  # the broker is down or refuses
        activity, error = None, f"could not ask the workers: {exc!r}"
    chart = None
    if activity is not None:
        series = per_minute(activity.reports, time.time(), task)
        chart = line_chart(
            series,
            title=f"lock events per minute, last hour{f' ({task})' if task else ''}",
            x_label=f"minutes ago (last {MINUTES})",
            y_label="events per minute",
        )
    return render_template(
        "stats.html",
        activity=activity,
        counters=COUNTERS,
        chart=chart,
        task=task,
        error=error,
        refresh=_refresh(),
    )


def metrics() -> Response:
    """Every worker's counters, and the locks in the store, in Prometheus text format."""
    body, content_type = metrics_body(dashboard())
    return Response(body, 200, {"Content-Type": content_type})


def login() -> BaseResponse | tuple[str, int] | str:
    """Ask for the dashboard's token (token authentication only)."""
    auth = dashboard().auth
    target = request.values.get("next", "")
    if not target.startswith("/") or target.startswith("//"):
        target = url_for("locks")
    if auth is None or auth.kind != "token":
        return redirect(target)
    if request.method == "POST":
        if auth.accepts_token(request.form.get("token", "")):
            auth.log_in(session)
            return redirect(target, 303)
        return render_template("login.html", next=target, failed=True), 401
    return render_template("login.html", next=target, failed=False)


def logout() -> BaseResponse:
    """Forget the session's login and CSRF token."""
    session.clear()
    return redirect(url_for("login"), 303)
