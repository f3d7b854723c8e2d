"""The dashboard's semaphore permits and rate keys, in a real headless Chromium.

A threads worker holds the three permits of a ``lock_limit=3`` task (its calls
wait behind a gate); two rate keys of a ``3/m`` rate are in use, one of them
full. The locks page must list each permit with its holder (task id, worker,
pid, fence, TTL) and each rate key with used/limit and the time until a slot
frees; the screenshot is checked for the full rate key's meter colour.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_redlock import singleton
from tests.browser import require_browser
from tests.celery_apps.limits import LIMIT, started
from tests.celery_harness import wait_until
from tests.integration.celery.conftest import WorkerFactory
from tests.integration.celery.test_web_dashboard import Camera, text_of
from tests.web_harness import DashboardProcess

FULL_METER = (213, 94, 0)  # a full rate key's meter, #d55e00


@pytest.mark.timeout(120)
def test_locks_page_lists_every_permit_holder_and_each_rate_keys_use(
    storm_env: dict[str, str],
    storm_app: Celery,
    worker_factory: WorkerFactory,
    db9: redis.Redis,
    prefix: str,
    tmp_path: Path,
) -> None:
    """Three permits held by three running calls, and rate keys at 2/3 and 3/3, on one page."""
    require_browser()
    from selenium.webdriver.common.by import By

    from tests.browser import chromium

    worker = worker_factory("threads", 4)
    gate = f"{prefix}:gate:{uuid.uuid4().hex}"
    task = storm_app.tasks["limits.skip"]
    ids = [task.apply_async(("g", 0, gate)).id for _ in range(LIMIT)]

    @singleton(client=db9, rate="3/m", rate_key="account", key_prefix=prefix, name="web.api")
    def call(account: str) -> None:
        pass

    try:
        wait_until(lambda: len(started(db9, prefix)) == LIMIT, 30, message="three holders")
        for account in ("half", "half", "full", "full", "full"):
            call(account)
        dashboard = DashboardProcess("tests.celery_apps.storm", storm_env, [], tmp_path / "logs")
        with dashboard as web, chromium() as browser:
            camera = Camera(browser, tmp_path / "screenshots")
            browser.get(f"{web.url}/?refresh=0")
            text_of(browser, "#permits")
            permits = browser.find_elements(By.CSS_SELECTOR, "#permits tbody tr")
            assert sorted(row.get_attribute("data-slot") for row in permits) == ["0", "1", "2"]
            holders = [row.find_element(By.CSS_SELECTOR, ".holder").text for row in permits]
            assert sorted(holders) == sorted(ids)
            permit_text = text_of(browser, "#permits")
            assert worker.nodename in permit_text and str(worker.pid) in permit_text
            rates = {
                row.find_element(By.CSS_SELECTOR, ".usage").text: row
                for row in browser.find_elements(By.CSS_SELECTOR, "#rates tbody tr")
            }
            assert set(rates) == {"2/3", "3/3"}
            assert rates["2/3"].find_element(By.CSS_SELECTOR, ".free-in").text == "now"
            assert rates["3/3"].find_element(By.CSS_SELECTOR, ".free-in").text.endswith("s")
            assert "web.api" in rates["3/3"].text and "60s" in rates["3/3"].text
            camera.shoot("limits", colour=FULL_METER)
        camera.publish()
    finally:
        db9.set(gate, 1)
