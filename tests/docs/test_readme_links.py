"""The READMEs' relative links point at files that exist (the docs site checks its own)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    links = LINK.findall(page.read_text())
    return [link for link in links if not re.match(r"[a-z]+:|#", link)]


@pytest.mark.parametrize("page", ["README.md", "example_project/README.md"])
def test_relative_links_resolve(page):
    """Every relative link of the page names an existing file."""
    path = REPO_ROOT / page
    broken = [
        link for link in relative_links(path) if not (path.parent / link.split("#", 1)[0]).exists()
    ]
    assert not broken, f"{page}: {broken}"


def test_readme_links_every_docs_page():
    """The README's documentation list reaches every page of the site."""
    linked = {Path(link.split("#", 1)[0]).name for link in relative_links(REPO_ROOT / "README.md")}
    pages = {page.name for page in (REPO_ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= linked, sorted(pages - linked)
