"""The runner of the documentation's examples fails where it must.

These pages are written here, not read from docs/: each one breaks, or
follows, one convention of tests/docs/examples.py, so the executable
documentation cannot pass by accident (a marker without a reason, a reason
the page does not state, an example that does not run, output that differs).
"""

from __future__ import annotations

import pytest

from tests.docs.examples import (
    Address,
    DocsError,
    ExampleFailed,
    PageSession,
    console_commands,
    examples,
    output_matches,
    parse_page,
    run_page,
    undefined_names,
)

FENCE = "```"


def page(*parts: str) -> str:
    return "\n".join(parts) + "\n"


def python(code: str) -> str:
    return f"{FENCE}python\n{code}\n{FENCE}"


def console(text: str) -> str:
    return f"{FENCE}console\n{text}\n{FENCE}"


@pytest.fixture
def session(tmp_path):
    with PageSession(workdir=tmp_path / "reader", address=Address(1), timeout=30) as s:
        yield s


def test_a_marker_without_a_reason_is_an_error():
    """``skip`` must say why."""
    text = page("Intro.", "<!-- test: skip -->", python("print(1)"))
    with pytest.raises(DocsError, match="needs a reason"):
        parse_page("t.md", text)


def test_a_reason_the_page_does_not_state_is_an_error():
    """The reason must also be in the page's text, where readers see it."""
    text = page('<!-- test: skip reason="it deploys to production" -->', python("deploy()"))
    with pytest.raises(DocsError, match="must say why"):
        parse_page("t.md", text)


def test_a_stated_reason_skips_the_example():
    """A marker whose reason the page states (formatting aside) marks its block skipped."""
    text = page(
        "This one is not run: it *deploys to `production`*.",
        '<!-- test: skip reason="it deploys to production" -->',
        python("deploy()"),
    )
    (block,) = examples("t.md", text)
    assert block.skipped
    assert block.marker is not None and block.marker.reason == "it deploys to production"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["<!-- test: skip reason='single quotes' -->", python("x = 1")], "fields"),
        (['<!-- test: ignore reason="x" -->', python("x = 1")], "unknown marker action"),
        (['<!-- test: skip because="x" reason="x" -->', python("x = 1")], "unknown marker"),
        (['<!-- test: skip reason="x" -->', "", python("x = 1")], "right before a fenced block"),
        (['<!-- test: skip reason="x" -->', "```text\nx\n```", "x"], "only examples"),
        (["```\nprint(1)\n```"], "label the block"),
        (["```pyhton\nprint(1)\n```"], "unknown label"),
        (["```python\nprint(1)"], "never closed"),
        (["```console\nls\n```"], "starts with a `\\$ ` command"),
    ],
)
def test_broken_conventions_are_errors(lines, message):
    """Misspelt markers and labels, stray markers and unclosed fences fail, never skip silently."""
    with pytest.raises(DocsError, match=message):
        parse_page("t.md", page(*lines))


def test_blocks_keep_their_page_lines_and_indentation():
    """A block knows its first line; code inside a list item is dedented to its fence only."""
    text = page("- step", "", "  ```python", "  if True:", "      x = 1", "  ```")
    (block,) = examples("t.md", text)
    assert block.line == 4
    assert block.code == "if True:\n    x = 1\n"


def test_an_unmarked_example_that_fails_fails_the_test(session):
    """An exception in an unmarked block is reported with the page's own line number."""
    text = page("Intro.", python("x = 1\nraise RuntimeError('broken example')"))
    (block,) = examples("t.md", text)
    with pytest.raises(ExampleFailed, match=r"t\.md:3 raised") as failed:
        session.run(block)
    assert 'File "t.md", line 4' in str(failed.value)
    assert "RuntimeError: broken example" in str(failed.value)


def test_python_blocks_share_a_session_and_files_are_saved(session):
    """A ``# name.py`` block is saved and imported; later blocks see earlier names and the file."""
    text = page(
        python("# shop.py\nPRICE = 3"),
        python("from shop import PRICE\ncount = 2"),
        python("assert PRICE * count == 6"),
    )
    blocks = examples("t.md", text)
    assert [block.filename for block in blocks] == ["shop.py", None, None]
    for block in blocks:
        session.run(block)
    assert (session.workdir / "shop.py").read_text() == "# shop.py\nPRICE = 3\n"


def test_a_file_block_that_fails_to_import_fails(session):
    """Saving a file is not enough: it must import."""
    (block,) = examples("t.md", page(python("# bad.py\nimport no_such_module_here")))
    with pytest.raises(ExampleFailed, match="ModuleNotFoundError"):
        session.run(block)


def test_a_hanging_block_fails_after_the_timeout(tmp_path):
    """A block that never returns fails the test instead of hanging it."""
    (block,) = examples("t.md", page(python("import time\ntime.sleep(60)")))
    session = PageSession(workdir=tmp_path, address=Address(1), timeout=1)
    with session, pytest.raises(ExampleFailed, match="still running after 1s"):
        session.run(block)


def test_console_output_is_compared(session):
    """Output shown in the page must be what the command prints; ``...`` stands for any text."""
    (ok,) = examples("t.md", page(console("$ printf 'a 1\\nb 2\\n'\na ...\nb 2")))
    session.run(ok)
    (wrong,) = examples("t.md", page(console("$ echo hello\ngoodbye")))
    with pytest.raises(ExampleFailed, match="the page shows"):
        session.run(wrong)


def test_printed_output_is_compared_when_the_page_shows_it(session, tmp_path):
    """A text block marked ``output`` after a Python block must be what that block printed."""
    shown = page(python("print('total', 6)"), "<!-- test: output -->", "```text\ntotal ...\n```")
    assert [block.location for block in run_page("t.md", session, shown)] == ["t.md:2"]
    wrong = page(python("print('total', 7)"), "<!-- test: output -->", "```text\ntotal 6\n```")
    with pytest.raises(ExampleFailed, match=r"t\.md:2 printed\ntotal 7\n"):
        list(run_page("t.md", session, wrong))


def test_an_output_marker_needs_a_python_block_before_it():
    """Output is shown for a Python example only, right after it."""
    text = page(console("$ echo 1"), "<!-- test: output -->", "```text\n1\n```")
    with pytest.raises(DocsError, match="output marker goes on a text block"):
        parse_page("t.md", text)


def test_console_exit_status_is_compared(session):
    """A command fails the example by exiting non-zero, unless the page shows that status."""
    (shown,) = examples("t.md", page(console("$ false\n(exit status 1)")))
    session.run(shown)
    (unshown,) = examples("t.md", page(console("$ false")))
    with pytest.raises(ExampleFailed, match="exited with 1, the page shows 0"):
        session.run(unshown)


def test_console_commands_parse_continuations_and_output():
    """``\\`` continues a command; each command owns the output lines after it."""
    text = page(console("$ echo one \\\n    two\none two\n$ true\n\n$ false\n(exit status 1)"))
    (block,) = examples("t.md", text)
    commands = console_commands(block)
    assert [(c.command, c.expected, c.exit_status) for c in commands] == [
        ("echo one  two", ("one two",), 0),
        ("true", (), 0),
        ("false", (), 1),
    ]
    assert [c.line for c in commands] == [2, 5, 7]
    assert [c.is_worker for c in commands] == [False, False, False]


@pytest.mark.parametrize(
    ("command", "worker"),
    [
        ("celery -A proj worker -l INFO", "celery"),
        ("celery -A proj worker -l INFO -c 2  # two processes", "celery"),
        ("celery -A proj redlock check", None),
        ("python -c 'print(\"worker\")'", None),
        ("rq worker --url redis://localhost:6379/0 --with-scheduler", "rq"),
        ("rq worker --url redis://localhost:6379/0 --burst", None),
        ("rq info --url redis://localhost:6379/0", None),
    ],
)
def test_worker_commands_are_recognised(command, worker):
    """Only ``celery ... worker`` and a non-burst ``rq worker`` run in the background."""
    (block,) = examples("t.md", page(console(f"$ {command}")))
    assert console_commands(block)[0].worker == worker
    assert console_commands(block)[0].is_worker is (worker is not None)


def test_further_local_ports_are_pointed_at_their_own_servers():
    """``localhost:6380`` and ``:6381`` move to the servers given for them, and back."""
    address = Address(7001, {6380: 7002, 6381: 7003})
    text = '["redis://localhost:6379/0", "redis://localhost:6380/0", "redis://127.0.0.1:6381"]'
    moved = '["redis://localhost:7001/0", "redis://localhost:7002/0", "redis://127.0.0.1:7003"]'
    assert address.rewrite(text) == moved
    assert address.restore(moved) == text
    assert Address.wanted(text) == [6380, 6381]
    assert Address.wanted("redis://localhost:6379/0") == []
    # A private port that is also a shown one is moved once, not twice.
    assert Address(6380, {6380: 7002}).rewrite("localhost:6379 localhost:6380") == (
        "localhost:6380 localhost:7002"
    )


@pytest.mark.parametrize(
    ("expected", "actual", "matches"),
    [
        (["a", "b"], "a\nb\n", True),
        (["a", "b"], "a\nc\n", False),
        (["lock store ... (Redis ...) answers"], "lock store x (Redis 7.0.15) answers", True),
        (["first", "...", "last"], "first\n1\n2\nlast", True),
        (["a  "], "\na\n\n", True),
        (["a"], "a\nextra", False),
    ],
)
def test_output_matching(expected, actual, matches):
    """``...`` is the only wildcard; trailing spaces and surrounding blank lines do not count."""
    assert output_matches(expected, actual) is matches


def test_the_address_points_only_the_local_redis_elsewhere():
    """``localhost:6379``, ``127.0.0.1:6379`` and ``Redis()`` move; other addresses do not."""
    address = Address(7001)
    text = (
        'Celery(broker="redis://localhost:6379/0"); redis.Redis(); '
        '"redis://127.0.0.1:6379/1"; "redis://locks.internal:6379/3"; Redis(db=1)'
    )
    assert address.rewrite(text) == (
        'Celery(broker="redis://localhost:7001/0"); redis.Redis(port=7001); '
        '"redis://127.0.0.1:7001/1"; "redis://locks.internal:6379/3"; Redis(db=1)'
    )
    assert address.restore("lock store redis://localhost:7001/0") == (
        "lock store redis://localhost:6379/0"
    )


def test_undefined_names_are_found_at_any_depth():
    """A name used only in a function body, a class or a comprehension still counts."""
    code = (
        "import os\n"
        "def task(account):\n"
        "    ledger.write(account, os.sep, [gateway(x) for x in range(3)])\n"
        "class Shop:\n"
        "    price = PRICE\n"
        "total = len(known_before)\n"
    )
    assert undefined_names(code, {"known_before"}) == ["PRICE", "gateway", "ledger"]


def test_an_example_using_a_name_the_page_never_defines_fails(session):
    """A placeholder such as ``ledger`` fails the page, even in a function it never calls."""
    text = page(
        python("PRICE = 3"),
        python("def book(amount):\n    ledger.write(amount * PRICE)"),
    )
    with pytest.raises(ExampleFailed, match=r"t\.md:5 uses ledger, which the page never defines"):
        list(run_page("t.md", session, text))
