"""The dashboard in a real headless Chromium, with real workers holding real locks.

A threads worker holds a lock for a task that is still running (a live
holder); a prefork worker held another one when it was killed outright (a
dead holder: its node no longer answers, its pid is gone on this host). The
reaper is off here, so only the dashboard can free the dead holder's lock.
Every page is photographed into the test's tmp dir and the pictures are
checked: size, the header bar, and what the page should show in colour. With
``REDLOCK_DOCS_SCREENSHOTS=<dir>`` they are also copied there (docs/images).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from celery import Celery

from tests.browser import chromium, read_png, require_browser
from tests.celery_harness import task_states, wait_until
from tests.integration.celery.conftest import WorkerFactory
from tests.web_harness import DashboardProcess

LONG_TTL = 60.0
HEADER = (36, 52, 71)  # the header bar, #243447
TABLE_HEAD = (238, 241, 244)  # table headers, #eef1f4
REFUSED = (253, 232, 228)  # refusal box, #fde8e4
SERIES = (0, 114, 178)  # first chart series, #0072b2


@pytest.fixture
def storm_env(storm_env: dict[str, str]) -> dict[str, str]:
    """Installed workers (stats), 60 s locks, no reaper: the dashboard frees the dead lock."""
    settings = json.dumps({"redlock_reaper": False})
    return {
        **storm_env,
        "REDLOCK_TEST_INSTALL": "1",
        "REDLOCK_TEST_TTL": str(LONG_TTL),
        "REDLOCK_TEST_SETTINGS": settings,
    }


@pytest.fixture
def browser_ready() -> None:
    """Chromium is there; checked before any worker starts (skip, or fail under CI=true)."""
    require_browser()


@pytest.fixture
def gates(db9: redis.Redis, worker_factory: WorkerFactory) -> Iterator[list[str]]:
    """Gate keys of held calls; opened at teardown so workers stop at once."""
    opened: list[str] = []
    yield opened
    for gate in opened:
        db9.set(gate, 1)


def hold(app: Celery, db9: redis.Redis, prefix: str, gates: list[str], x: Any, queue: str):
    """Start ``storm.hold(x)`` behind a gate; return (task id, lock key) once it holds the lock."""
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    gates.append(gate)
    task = app.tasks["storm.hold"]
    key = task.lock_key_for(x, 0, gate)
    result = task.apply_async((x, 0, gate), queue=queue)
    wait_until(lambda: db9.exists(key), timeout=20, message=f"lock {key} taken")
    return result.id, key


class Camera:
    """Takes, checks and keeps the screenshots of one test."""

    def __init__(self, browser: Any, directory: Path) -> None:
        self.browser = browser
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.taken: list[Path] = []

    def shoot(self, name: str, *, colour: tuple[int, int, int] | None = None) -> Any:
        """Save the viewport as ``name``.png and check it; return the decoded picture."""
        path = self.directory / f"{name}.png"
        assert self.browser.save_screenshot(str(path))
        picture = read_png(path)
        width, height = picture.size
        assert width >= 1000 and height >= 600, picture.size
        assert path.stat().st_size > 15_000, f"{name}: {path.stat().st_size} bytes, nearly blank"
        assert picture.share(HEADER, (0, 0, width, 36)) > 0.5, f"{name}: no header bar"
        assert len(picture.colours()) > 20, f"{name}: too few colours for a page of text"
        if colour is not None:
            assert picture.colours().get(colour, 0) > 100, f"{name}: {colour} missing"
        self.taken.append(path)
        return picture

    def publish(self) -> None:
        """Copy the screenshots where REDLOCK_DOCS_SCREENSHOTS says (the docs' images)."""
        target = os.environ.get("REDLOCK_DOCS_SCREENSHOTS")
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            for path in self.taken:
                shutil.copy(path, Path(target) / f"dashboard-{path.name}")


def rows(browser: Any) -> dict[str, Any]:
    from selenium.webdriver.common.by import By

    return {
        row.get_attribute("data-key"): row
        for row in browser.find_elements(By.CSS_SELECTOR, "#locks tbody tr")
    }


def text_of(browser: Any, selector: str) -> str:
    """The text of the element at ``selector``, waiting for it (a click loads a new page)."""
    from selenium.webdriver.common.by import By

    found = wait_until(
        lambda: browser.find_elements(By.CSS_SELECTOR, selector),
        timeout=10,
        message=f"{selector} on {browser.current_url}",
    )
    return str(found[0].text)


@pytest.mark.timeout(180)
def test_locks_filter_detail_release_and_stats_in_a_browser(
    browser_ready: None,
    storm_env: dict[str, str],
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
    tmp_path: Path,
) -> None:
    """The locks page lists both holders with TTL; the filter keeps one; the dead holder's
    lock is released through the confirmation step; the live one's is refused; stats chart."""
    from selenium.webdriver.common.by import By

    live = worker_factory.create("threads", 2)
    doomed = worker_factory.create("prefork", 1, queues=[f"{prefix}.doomed"])
    worker_factory.start(live, doomed)
    live_id, live_key = hold(storm_app, db9, prefix, gates, "live", live.queues[0])
    dead_id, dead_key = hold(storm_app, db9, prefix, gates, "dead", doomed.queues[0])
    task = storm_app.tasks["storm.hold"]
    quick = [task.delay(x, 0).id for x in range(5)]
    wait_until(
        lambda: all(s == "SUCCESS" for s, _ in task_states(storm_app, quick).values()),
        timeout=30,
        message="quick calls done",
    )
    children = doomed.child_pids()
    doomed.kill()
    wait_until(
        lambda: not any(os.path.exists(f"/proc/{pid}") for pid in children),
        timeout=10,
        message="the doomed worker's pool processes gone",
    )
    live_value = db9.get(live_key)

    args = ["--timeout", "1", "--refresh", "30"]
    dashboard = DashboardProcess("tests.celery_apps.storm", storm_env, args, tmp_path / "logs")
    with dashboard as web, chromium() as browser:
        camera = Camera(browser, tmp_path / "screenshots")
        browser.get(f"{web.url}/")
        listed = rows(browser)
        assert set(listed) >= {live_key, dead_key}
        assert live_id in listed[live_key].text and dead_id in listed[dead_key].text
        assert live.nodename in listed[live_key].text
        ttl = listed[live_key].find_element(By.CSS_SELECTOR, "td.ttl").text
        assert ttl.endswith("s") and 0 < float(ttl[:-1]) <= LONG_TTL
        refresh = browser.find_element(By.CSS_SELECTOR, 'meta[http-equiv="refresh"]')
        assert refresh.get_attribute("content") == "30.0"
        camera.shoot("locks", colour=TABLE_HEAD)

        browser.find_element(By.NAME, "queue").send_keys(doomed.queues[0])
        browser.find_element(By.ID, "apply-filters").click()
        wait_until(lambda: "queue=" in browser.current_url, timeout=10, message="filtered")
        assert list(rows(browser)) == [dead_key]
        camera.shoot("locks-filtered", colour=TABLE_HEAD)

        rows(browser)[dead_key].find_element(By.TAG_NAME, "a").click()
        text_of(browser, "#facts")
        liveness = text_of(browser, "#liveness")
        assert liveness.startswith("gone") and "is not running on this host" in liveness
        assert text_of(browser, "#task-state") in ("PENDING", "STARTED", "FAILURE")
        camera.shoot("lock")

        browser.find_element(By.ID, "release-button").click()
        text_of(browser, "#confirm-form")
        assert text_of(browser, "#checked").startswith("gone")
        assert not browser.find_elements(By.ID, "force")  # a dead holder needs no force
        camera.shoot("release-confirm")
        browser.find_element(By.ID, "confirm-release").click()
        flash = text_of(browser, ".flash")
        assert flash.startswith(f"released {dead_key}") and dead_id in flash
        assert db9.get(dead_key) is None and dead_key not in rows(browser)
        camera.shoot("released")

        browser.get(f"{web.url}/release?key={quote(live_key)}")
        assert "is alive" in text_of(browser, "#warning")
        browser.find_element(By.ID, "confirm-release").click()  # without "force"
        refusal = text_of(browser, "#refused")
        assert refusal.startswith("refused:") and f"worker {live.nodename} answers ping" in refusal
        assert db9.get(live_key) == live_value
        camera.shoot("release-refused", colour=REFUSED)

        browser.get(f"{web.url}/stats")
        by_task = text_of(browser, "#by-task")
        assert "storm.hold" in by_task
        assert len(browser.find_elements(By.CSS_SELECTOR, "#chart polyline.series")) == 6
        assert live.nodename in text_of(browser, "#by-worker")
        camera.shoot("stats", colour=SERIES)
    camera.publish()


@pytest.mark.timeout(90)
def test_read_only_dashboard_shows_no_action_in_a_browser(
    browser_ready: None,
    storm_env: dict[str, str],
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    gates: list[str],
    tmp_path: Path,
) -> None:
    """--read-only: the page says so and the lock page has no release button."""
    from selenium.webdriver.common.by import By

    live = worker_factory("threads", 2)
    _live_id, live_key = hold(storm_app, db9, prefix, gates, "ro", live.queues[0])
    dashboard = DashboardProcess(
        "tests.celery_apps.storm", storm_env, ["--read-only"], tmp_path / "logs"
    )
    with dashboard as web, chromium() as browser:
        camera = Camera(browser, tmp_path / "screenshots")
        browser.get(f"{web.url}/lock?key={quote(live_key)}")
        assert "read-only: no action can be taken" in text_of(browser, "#mode")
        assert text_of(browser, "#liveness").startswith("alive")
        assert not browser.find_elements(By.ID, "release-form")
        assert not browser.find_elements(By.TAG_NAME, "button")
        camera.shoot("read-only")
    camera.publish()
