"""The griffe extension that adapts the package's docstrings for the API reference."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 10):
    pytest.skip("the docs toolchain needs Python >= 3.10", allow_module_level=True)

PATH = Path(__file__).resolve().parents[2] / "docs" / "_ext" / "docstrings.py"
spec = importlib.util.spec_from_file_location("redlock_docs_ext", PATH)
assert spec is not None and spec.loader is not None
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (":class:`celery_redlock.Lock`", "`celery_redlock.Lock`"),
        (":class:`~celery_redlock.calls.options.LockOptions`", "`LockOptions`"),
        (":py:func:`current_lock`", "`current_lock`"),
        (
            ":data:`the key spec <celery_redlock.core.keys.KeySpec>`",
            "`celery_redlock.core.keys.KeySpec`",
        ),
        ("see :meth:`~Lock.release` and :attr:`fence`.", "see `release` and `fence`."),
        ("plain ``code`` stays", "plain ``code`` stays"),
    ],
)
def test_sphinx_roles_become_code_spans(text, expected):
    """A Sphinx role renders as a code span of its target; ``~`` keeps the last part."""
    assert ext.markdown_roles(text) == expected


def test_comment_above_collects_the_whole_block():
    """The ``#:`` lines right above an assignment form its docstring, in order."""
    lines = ["x = 1", "#: first line", "#: second line", "NAME = 2"]
    assert ext.comment_above(lines, 4) == "first line\nsecond line"


def test_comment_above_ignores_plain_comments():
    """A plain comment, or none, gives no docstring."""
    assert ext.comment_above(["# why, not what", "NAME = 2"], 2) is None
    assert ext.comment_above(["NAME = 2"], 1) is None
