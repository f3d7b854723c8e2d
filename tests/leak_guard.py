"""Plugin of the suite: a test that leaves a socket (or any resource) to the collector fails.

An object in a reference cycle is freed only by a pass of the cyclic garbage
collector, which runs whenever allocations reach a threshold: inside whatever
test happens to be running. A ``ResourceWarning: unclosed <socket ...>`` then
fails that later, unrelated test. This plugin runs a collection at the end of
every test, after its fixtures are torn down, so such a warning fails the test
that leaked the object, with where it was allocated when tracemalloc is on
(``PYTHONTRACEMALLOC=20``).

A full collection walks every tracked object, and what stays alive from test
to test (caches, module-scoped fixtures, what the suite imports as it goes)
adds up: with only what was alive at the end of collection frozen out of the
collector, the passes took 325 s of a 30-minute run of the full suite (2,459
tests, 132 ms each on average). So every pass now ends with ``gc.freeze()``:
what survived it is out of the collector's reach, and the next test's pass
walks only what that test allocated (well under a millisecond).

The price: a cycle of frozen objects is never collected, so an object that
outlived its own test's pass (held by a module-scoped fixture, a module's
global, a cache) and is later dropped unclosed would escape. So the last test
of each file also gets a pass with everything thawed (``gc.unfreeze()``),
after pytest has torn down that file's fixtures: what it finds fails that
test, naming the tests since the previous such pass, one of which dropped it.
That pass walks everything, about 115 ms. On tests/unit plus
tests/integration/celery the guard's time went from 12.1 s (762 tests,
16 ms each) to 6.9 s (766 tests and 58 files: 0.2 s after tests, 6.7 s at
file ends). The suite's directories run one at a time spent 15 s in all in
the guard; in one session the thawed passes walk more, but they are about
127, not 2,459. The summary line gives the figures of each run. The frozen
objects are thawed again at the session's end, where pytest's own final
collection still reports anything left.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
import warnings
from collections.abc import Generator

import pytest

# The guard's own cost over the session, for the summary: passes after each
# test and thawed passes at the end of a file, [count, seconds] each.
_spent = {"test": [0, 0.0], "file": [0, 0.0]}
# The first test run since the last thawed pass: where a leak that pass finds
# may have started.
_file_start: list[str | None] = [None]


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


def _collect(kind: str) -> list[str]:
    """One pass (of everything when ``kind`` is "file"); the resources it freed unclosed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.perf_counter()
        if kind == "file":
            gc.unfreeze()
        gc.collect()
        # What survived is alive for now: the next pass needs not walk it again.
        gc.freeze()
        _spent[kind][0] += 1
        _spent[kind][1] += time.perf_counter() - started
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
    return leaks


def _ends_a_file(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """Whether ``item`` is the last test of its file (and pytest tore down that file's fixtures)."""
    return nextitem is None or nextitem.path != item.path


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    """After the test's fixtures are gone, collect; a resource freed unclosed fails the test."""
    result = yield
    if _file_start[0] is None:
        _file_start[0] = item.nodeid
    reports = []
    leaks = _collect("test")
    if leaks:
        reports.append(
            "left to the garbage collector unclosed by this test:\n" + "\n\n".join(leaks)
        )
    if _ends_a_file(item, nextitem):
        first, _file_start[0] = _file_start[0], None
        leaks = _collect("file")
        if leaks:
            reports.append(
                f"left to the garbage collector unclosed by one of the tests from {first} to "
                "this one: it outlived the pass after the test that made it, and only the "
                "pass at the end of the file found it:\n" + "\n\n".join(leaks)
            )
    if reports:
        pytest.fail("\n\n".join(reports), pytrace=False)
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say what the guard cost, so that a slower suite can be traced to it or cleared of it."""
    (tests, in_tests), (files, in_files) = _spent["test"], _spent["file"]
    if tests:
        terminalreporter.write_line(
            f"leak guard: {tests} collections after tests, {in_tests:.1f} s in all; "
            f"{files} at the end of a file, {in_files:.1f} s"
        )
