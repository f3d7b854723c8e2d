"""bench/RESULTS.md is shared: each benchmark owns one ``## `` section of it.

A benchmark replaces its own section (or appends it) and leaves the others as
they are, re-reading the file right before writing.
"""

from __future__ import annotations

import re
from pathlib import Path

TITLE = "# Benchmark results\n\nWritten by the scripts in `bench/`; see `bench/README.md`.\n"


def write_section(path: Path, heading: str, section: str) -> None:
    """Put ``section`` (which starts with the line ``heading``) into ``path``."""
    text = path.read_text() if path.exists() else ""
    if not text.startswith(TITLE):
        text = TITLE
    pattern = re.compile(rf"^{re.escape(heading)}\s*$.*?(?=^## |\Z)", re.M | re.S)
    body = section.rstrip("\n") + "\n"
    if pattern.search(text):
        text = pattern.sub(lambda _: body + "\n", text, count=1).rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)


def as_section(markdown: str, heading: str) -> str:
    """Turn a standalone report (``# `` title, ``## `` parts) into a section under ``heading``."""
    _title, *rest = markdown.splitlines()
    return "\n".join([heading, *(f"#{line}" if line.startswith("## ") else line for line in rest)])
