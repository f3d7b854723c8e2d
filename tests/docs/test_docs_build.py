"""The documentation site builds with MkDocs in strict mode: no warning of any kind.

CI runs only ``scripts/test``, so this is where the docs build is checked; it
runs the same command as ``tox -e docs``, into a temporary directory.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# The docs toolchain (mkdocstrings-python 2, griffe 2) needs Python 3.10; the
# test extra installs it there, so on 3.10+ a missing tool fails the test.
pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 10), reason="the docs toolchain needs Python >= 3.10"
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Build the site once for this module; return its directory and the build's output."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=90,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    return out, log


@pytest.mark.timeout(120)
def test_strict_build_has_no_warnings(site):
    """``mkdocs build --strict`` succeeds and logs no WARNING or ERROR line."""
    _, log = site
    bad = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not bad, log


@pytest.mark.timeout(120)
def test_every_page_in_docs_is_built(site):
    """Each Markdown page under docs/ becomes an HTML page (none is left out of the site)."""
    out, _ = site
    pages = sorted(p.relative_to(REPO_ROOT / "docs") for p in (REPO_ROOT / "docs").glob("*.md"))
    assert pages
    missing = [str(p) for p in pages if not (out / p.with_suffix(".html")).is_file()]
    assert not missing


@pytest.mark.timeout(120)
def test_api_reference_is_generated_from_docstrings(site):
    """The API page renders the docstrings, with Sphinx roles turned into code and ``#:`` read."""
    out, _ = site
    html = (out / "api.html").read_text()
    for name in (
        "celery.task.SingletonTask",
        "celery.guard.current_lock",
        "core.lock.Lock.acquire",
        "core.redlock.Redlock",
        "core.exceptions.LockNotAcquired",
    ):
        assert f'id="celery_redlock.{name}"' in html, name
    # A sentence from SingletonTask's docstring and one from the #: comment of SKIPPED.
    assert "takes a Redis lock keyed by its arguments" in html
    assert "Task state recorded for a call skipped" in html
    assert ":class:" not in html and ":func:" not in html and ":data:" not in html


@pytest.mark.timeout(120)
def test_code_blocks_render_as_blocks(site):
    """No fenced code block leaks into a page as text (a fence indented inside a list does)."""
    out, _ = site
    leaked = [
        page.name
        for page in sorted(out.glob("*.html"))
        if "```" in page.read_text() or "<p><code>python" in page.read_text()
    ]
    assert not leaked
