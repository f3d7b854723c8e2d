"""A real headless Chromium for the dashboard tests, and a reader of the screenshots it takes.

The browser is Debian's ``chromium`` with its ``chromedriver``, driven by
Selenium; nothing is downloaded at run time (the driver's path is given, so
Selenium Manager never runs, and ``SE_OFFLINE`` forbids it anyway).
``scripts/test`` installs both when it can. Without them the browser tests
skip with one line naming the install command, except under ``CI=true``,
where a missing browser fails them.

:func:`read_png` decodes a screenshot (with Pillow), so a test can check what
a page looks like, not just that it loaded.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = ["INSTALL_HINT", "Screenshot", "chromium", "read_png", "require_browser"]

INSTALL_HINT = "apt-get install -y chromium chromium-driver"
WINDOW = (1366, 900)


def _binaries() -> tuple[str | None, str | None]:
    return shutil.which("chromium"), shutil.which("chromedriver")


def require_browser() -> tuple[str, str]:
    """Return (chromium, chromedriver); skip the test without them (fail under CI=true)."""
    browser, driver = _binaries()
    if browser and driver:
        return browser, driver
    message = f"no Chromium/ChromeDriver for the browser tests; install them: {INSTALL_HINT}"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium session (Selenium WebDriver), quit at the end."""
    browser, driver_path = require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-extensions",
        "--no-first-run",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--hide-scrollbars",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


@dataclass(frozen=True)
class Screenshot:
    """A screenshot, decoded.

    Attributes:
        path: The PNG file.
        image: The picture in RGB (a Pillow image).
    """

    path: Path
    image: Any

    @property
    def size(self) -> tuple[int, int]:
        """Width and height in pixels."""
        return tuple(self.image.size)  # type: ignore[return-value]

    def colours(self, box: tuple[int, int, int, int] | None = None) -> dict[tuple[int, ...], int]:
        """Pixels per distinct colour, in the picture or in ``box`` (left, top, right, bottom)."""
        region = self.image.crop(box) if box else self.image
        width, height = region.size
        return {colour: count for count, colour in region.getcolors(width * height)}

    def share(
        self, colour: tuple[int, int, int], box: tuple[int, int, int, int] | None = None
    ) -> float:
        """The share of pixels of ``colour`` (within ``box``)."""
        counts = self.colours(box)
        return counts.get(colour, 0) / max(1, sum(counts.values()))


def read_png(path: Path) -> Screenshot:
    """Open a screenshot; fail unless it is a PNG."""
    from PIL import Image

    raw = Path(path).read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    with Image.open(path) as image:
        return Screenshot(Path(path), image.convert("RGB"))
