"""The documentation's examples run as the pages show them.

The examples are read from the Markdown of each page in ``PAGES`` (see
tests/docs/examples.py for the conventions), so an example cannot drift from
the code: each page runs in a directory of its own, against a private
``redis-server``, with real ``celery worker`` processes where the page starts
one. An example that cannot run carries a ``<!-- test: skip reason="..." -->``
marker, and its page says why.
"""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest

from tests.docs.examples import (
    PAGES,
    REPO_ROOT,
    Address,
    PageSession,
    examples,
    parse_page,
    run_page,
)

PIP_INSTALL = re.compile(r"pip install (?P<args>[^`\n#]+)")
REQUIREMENT = re.compile(r"(?P<target>[^\[\]]+)(?:\[(?P<extras>[^\]]*)\])?")


@pytest.mark.parametrize("page", PAGES)
def test_page_follows_the_example_conventions(page):
    """Every block is labelled; every marker sits on an example, with a reason the page states."""
    blocks = parse_page(page)
    assert any(block.kind for block in blocks), f"{page} has no example"


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, redis_server, redis_servers, tmp_path):
    """Every example of the page that is not marked runs, in page order, as the page shows it."""
    # A page running several masters names them localhost:6380 and :6381 too.
    wanted = Address.wanted((REPO_ROOT / page).read_text())
    more = {shown: server.port for shown, server in zip(wanted, redis_servers(len(wanted)))}
    address = Address(redis_server.port, more)
    session = PageSession(workdir=tmp_path / "reader", address=address)
    with session:
        ran = [block.location for block in run_page(page, session)]
    unmarked = [block.location for block in examples(page) if not block.skipped]
    assert ran == unmarked


def _extras() -> set[str]:
    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    return set(setup["options.extras_require"])


def _install_lines() -> list[tuple[str, str]]:
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    found = []
    for path in pages:
        for match in PIP_INSTALL.finditer(path.read_text()):
            found.append((str(path.relative_to(REPO_ROOT)), match["args"].strip()))
    return found


def test_install_lines_name_the_project_and_its_real_extras():
    """Each ``pip install`` in the docs names celery-redlock (or a clone) and extras it offers."""
    extras = _extras()
    lines = _install_lines()
    assert lines, "no pip install line found"
    wrong = []
    for page, args in lines:
        targets = [word for word in shlex.split(args) if not word.startswith("-")]
        for target in targets:
            found = REQUIREMENT.fullmatch(target)
            # The released name, or a clone: "." in its root, a path to it elsewhere.
            project = found is not None and (
                found["target"] == "." or Path(found["target"]).name == "celery-redlock"
            )
            if not project:
                wrong.append(f"{page}: pip install {args}: {target!r} is not celery-redlock")
                continue
            asked = {extra.strip() for extra in (found["extras"] or "").split(",") if extra}
            if asked - extras:
                wrong.append(f"{page}: pip install {args}: no extra {sorted(asked - extras)}")
    assert not wrong, "\n".join(wrong)


def test_quickstart_installs_the_celery_extra():
    """The quickstart installs what a Redis-broker worker needs: the celery extra."""
    installs = [args for page, args in _install_lines() if page == "docs/quickstart.md"]
    assert any("[celery]" in args for args in installs), installs
