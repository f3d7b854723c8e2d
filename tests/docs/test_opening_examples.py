"""The opening example of each page for use without Celery runs as a script, as it stands.

These pages (``singleton``, asyncio, RQ) are not in ``PAGES``: their later
examples are fragments that build on the first. Their first example is where
a newcomer starts, though, and is copied whole into a file: so it must define
every name it uses, run as a plain script (no top-level ``await``), and run
against a real Redis (a private ``redis-server``, see tests/docs/examples.py).
"""

from __future__ import annotations

import pytest

from tests.docs.examples import Address, Block, PageSession, examples, undefined_names

OPENING_PAGES = ("docs/decorator.md", "docs/asyncio.md", "docs/rq.md")


def opening_example(page: str) -> Block:
    """The first Python example of ``page``."""
    blocks = [block for block in examples(page) if block.kind == "python"]
    assert blocks, f"{page} has no Python example"
    return blocks[0]


@pytest.mark.parametrize("page", OPENING_PAGES)
def test_the_opening_example_defines_every_name_it_uses(page):
    """Copied into a file on its own, it meets no NameError."""
    block = opening_example(page)
    assert undefined_names(block.code, set(), page) == [], block.location


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", OPENING_PAGES)
def test_the_opening_example_runs_as_a_script(page, redis_server, tmp_path):
    """It runs in a fresh interpreter, as a saved file would, against a real Redis."""
    block = opening_example(page)
    session = PageSession(workdir=tmp_path / "reader", address=Address(redis_server.port))
    with session:
        session.run(block)
