"""The suite's leak guard (tests/leak_guard.py), run on small suites of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import leak_guard

pytest_plugins = ["pytester"]

# A socket in a reference cycle: only a pass of the cyclic collector frees it,
# and it warns that it was never closed.
_LEAKY = """
import socket


class Leaky:
    def __init__(self):
        self.me = self
        self.sock = socket.socket()
"""


def _run(pytester: pytest.Pytester, **modules: str) -> pytest.RunResult:
    pytester.makepyfile(leak_guard=Path(leak_guard.__file__).read_text())
    pytester.makepyfile(leaky=_LEAKY, **modules)
    # A process of its own: the guard freezes and thaws the collector, which
    # must not touch this session's own.
    return pytester.runpytest_subprocess("-p", "leak_guard", "-p", "no:cacheprovider", "-rA")


def _failed_teardowns(result: pytest.RunResult) -> list[str]:
    return [line for line in result.outlines if line.startswith("ERROR ")]


def test_a_socket_left_in_a_cycle_fails_the_test_that_left_it(pytester: pytest.Pytester) -> None:
    """The test that drops the cycle fails, and neither the test before it nor the one after."""
    result = _run(
        pytester,
        test_one="""
from leaky import Leaky

def test_before():
    pass

def test_leaks():
    Leaky()

def test_after():
    pass
""",
    )
    result.assert_outcomes(passed=3, errors=1)
    (error,) = _failed_teardowns(result)
    assert error.startswith("ERROR test_one.py::test_leaks - Failed: left to the garbage")
    result.stdout.fnmatch_lines(["*unclosed <socket*"])


@pytest.mark.parametrize(
    "made",
    [
        pytest.param("_kept = [Leaky()]\n\ndef test_keeps():\n    pass\n", id="at-import"),
        pytest.param(
            "_kept = []\n\ndef test_keeps():\n    _kept.append(Leaky())\n", id="by-a-test"
        ),
    ],
)
def test_a_cycle_that_outlived_its_test_is_found_before_its_file_ends(
    pytester: pytest.Pytester, made: str
) -> None:
    """A cycle kept past its own test's pass, then dropped by a later test, fails its file."""
    result = _run(
        pytester,
        test_one=f"""
from leaky import Leaky

{made}

def test_drops():
    _kept.clear()

def test_last():
    pass
""",
        test_two="def test_other_module():\n    pass\n",
    )
    result.assert_outcomes(passed=4, errors=1)
    (error,) = _failed_teardowns(result)
    assert error.startswith(("ERROR test_one.py::test_drops", "ERROR test_one.py::test_last"))
    result.stdout.fnmatch_lines(["*unclosed <socket*"])


def test_the_summary_gives_the_guards_cost(pytester: pytest.Pytester) -> None:
    """The run ends with the number of passes and their time, so its cost stays visible."""
    result = _run(pytester, test_one="def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["leak guard: 2 collections after tests, * s in all; 1 at the end of a file, * s"]
    )
