"""Plugin of the suite: a test that leaves a socket (or any resource) to the collector fails.

An object in a reference cycle is freed only by a pass of the cyclic garbage
collector, which runs whenever allocations reach a threshold: inside whatever
test happens to be running. A ``ResourceWarning: unclosed <socket ...>`` then
fails that later, unrelated test. This plugin runs a full collection at the end
of every test, after its fixtures are torn down, so such a warning fails the
test that leaked the object, with where it was allocated when tracemalloc is on
(``PYTHONTRACEMALLOC=20``).

A full collection walks every tracked object: about 80 ms each on the suite's
imports alone. The objects alive once collection is over (modules, test
functions, parametrize ids) are therefore frozen out of the collector for the
session, so each test's pass only walks what was allocated since. That is a
few milliseconds in a module's own run, but what stays alive from test to test
adds up: over the full suite the passes took 325 s of a 30-minute run (2,459
tests, 132 ms each on average; the summary line gives the figure of each run).
The frozen objects are thawed at the session's end, where pytest's own final
collection still reports anything left.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
import warnings
from collections.abc import Generator

import pytest

# The guard's own cost over the session: [collections, seconds], for the summary.
_spent = [0, 0.0]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Take everything alive after collection out of every later collection."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Give the frozen objects back to the collector for pytest's final pass."""
    gc.unfreeze()


def _allocated_at(source: object) -> str:
    trace = tracemalloc.get_object_traceback(source) if source is not None else None
    if trace is None:
        return "  (run with PYTHONTRACEMALLOC=20 to see where it was allocated)"
    return "\n".join(trace.format())


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """After the test's fixtures are gone, collect; a resource freed unclosed fails the test."""
    result = yield
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.perf_counter()
        gc.collect()
        _spent[0] += 1
        _spent[1] += time.perf_counter() - started
    leaks = []
    for warning in caught:
        if issubclass(warning.category, ResourceWarning):
            leaks.append(f"{warning.message}\n{_allocated_at(warning.source)}")
        else:
            # Only resource warnings are this plugin's business: others go
            # through the usual filters, as if no pass had caught them.
            warnings.warn_explicit(
                warning.message,
                warning.category,
                warning.filename,
                warning.lineno,
                source=warning.source,
            )
    if leaks:
        pytest.fail(
            "left to the garbage collector unclosed by this test:\n" + "\n\n".join(leaks),
            pytrace=False,
        )
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say what the guard cost, so that a slower suite can be traced to it or cleared of it."""
    if _spent[0]:
        terminalreporter.write_line(
            f"leak guard: {_spent[0]} collections after tests, {_spent[1]:.1f} s in all"
        )
