"""Faults under real Celery workers holding semaphore permits (``lock_limit=2``).

The tasks are the chaos suite's (``tests.celery_apps.chaos``, task
``chaos.limited``), and so is the checker: each execution records its permit
as ``<key>#<slot>`` and writes to the fenced store under that name, so
exclusion, fence order and fenced writes are checked per slot, where one
holder at a time is the rule (see docs/limits.md). On top, no more than
:data:`LIMIT` executions of one key may believe they hold a permit at once.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from collections.abc import Sequence

import pytest

from celery_redlock.core.semaphore_scripts import semaphore_keys
from tests.celery_apps.chaos import LIMIT, LIMITED_TASK, LOCK_TTL
from tests.celery_harness import wait_until
from tests.chaos import report
from tests.chaos.checker import Execution, Verdict
from tests.chaos.conftest import CeleryChaos

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.usefixtures("attempt")]


def by_task(executions: Sequence[Execution], task_id: str) -> list[Execution]:
    """The executions of one task id, in start order."""
    return sorted((e for e in executions if e.task_id == task_id), key=lambda e: e.start)


def most_believing(executions: Sequence[Execution]) -> dict[str, int]:
    """Per key, the most executions that believed at one instant that they held a permit."""
    spans: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for execution in executions:
        key = execution.key.rsplit("#", 1)[0]
        spans[key] += [(execution.start, 1), (execution.believed_until, -1)]
    most: dict[str, int] = {}
    for key, events in spans.items():
        inside = 0
        most[key] = 0
        for _, step in sorted(events):
            inside += step
            most[key] = max(most[key], inside)
    return most


def assert_safe(c: CeleryChaos, run: str, verdict: Verdict) -> None:
    """No violation per slot, no lost task, never more than LIMIT believing holders per key."""
    assert not verdict.violations, verdict.describe()
    assert not verdict.lost, verdict.describe()
    assert set(most_believing(c.executions(run)).values()) <= set(range(1, LIMIT + 1))


@pytest.mark.timeout(60)
def test_sigstop_of_a_permit_holder_beyond_its_ttl(celery_chaos: CeleryChaos) -> None:
    """A holder frozen past lock_ttl loses its permit to the next caller, who takes its
    slot with a higher fence; on waking it learns it lost the permit, its release leaves
    the new holder's permit alone, and its late write to its slot is refused."""
    c = celery_chaos
    run = c.new_run()
    (first,) = c.submit(LIMITED_TASK, run, [("res", 1.0)])
    (stale,) = c.wait_running(run, 1)
    os.kill(stale.pid, signal.SIGSTOP)
    try:
        # One permit is free: one of the two runs at once, in the other slot; the other
        # is requeued until the frozen holder's permit expires, then takes its slot.
        second, third = c.submit(LIMITED_TASK, run, [("res", 2.5), ("res", 2.5)])
        wait_until(
            lambda: by_task(c.running(run), second) and by_task(c.running(run), third),
            20,
            message="both new holders to start",
        )
    finally:
        os.kill(stale.pid, signal.SIGCONT)
    (taker,) = [e for e in c.executions(run) if e.task_id in (second, third) and e.key == stale.key]
    states = c.wait_settled([first], timeout=20)
    # The stale holder has run its release by now: the new holder's permit is intact.
    name = stale.key.rsplit("#", 1)[0]
    permits = c.lock_store.client().zrange(semaphore_keys(name).permits, 0, -1)
    assert any(taker.task_id.encode() in member for member in permits), "stale release hit it"
    states.update(c.wait_settled([second, third], timeout=20))

    verdict = c.verdict(run, [first, second, third], states)
    report.record("semaphore: SIGSTOP of a permit holder beyond lock_ttl", verdict, faults=1)
    assert_safe(c, run, verdict)
    old = by_task(c.executions(run), first)[0]
    new = by_task(c.executions(run), taker.task_id)[0]
    assert old.lost, "the frozen holder never learned it lost its permit"
    assert old.believed_until <= new.start and new.fence > old.fence
    assert [w.applied for w in old.writes] == [True, False], old.writes
    assert all(w.applied for w in new.writes)
    assert "was lost before the task finished" in "".join(w.log() for w in c.workers)


@pytest.mark.timeout(60)
def test_lock_store_frozen_beyond_the_ttl_with_permits_held(celery_chaos: CeleryChaos) -> None:
    """The lock store hangs (SIGSTOP) for longer than lock_ttl while both permits of a key
    are held and more calls wait: the holders find out, nothing is lost, never more than
    LIMIT believing holders of the key."""
    c = celery_chaos
    run = c.new_run()
    ids = c.submit(LIMITED_TASK, run, [("res", 1.5)] * 6)
    holders = {e.id for e in c.wait_running(run, LIMIT)}
    c.lock_store.pause()
    try:
        wait_until(
            lambda: all(
                e.invalid_at is not None or e.finished for e in c.executions(run) if e.id in holders
            ),
            LOCK_TTL * 5,
            message="the holders to see their permits expire",
        )
    finally:
        c.lock_store.resume()
    states = c.wait_settled(ids, timeout=40)

    verdict = c.verdict(run, ids, states)
    report.record("semaphore: lock store frozen (SIGSTOP) beyond lock_ttl", verdict, faults=1)
    assert_safe(c, run, verdict)
    assert verdict.stale >= LIMIT
    assert {state for state, _ in states.values()} == {"SUCCESS"}


@pytest.mark.timeout(60)
def test_lock_store_restarted_empty_while_permits_are_held(celery_chaos: CeleryChaos) -> None:
    """Not promised: a lock store that restarts empty forgets the permits held.

    The waiting calls take both permits at once, so up to LIMIT new holders run
    beside the old ones until each old holder's next renewal (a third of the TTL)
    tells it its permit is gone. The fence, reseeded from the server clock, is
    higher, so each old holder's late write to its slot is refused.
    """
    c = celery_chaos
    run = c.new_run()
    firsts = c.submit(LIMITED_TASK, run, [("res", 2.0)] * LIMIT)
    olds = c.wait_running(run, LIMIT)
    seconds = c.submit(LIMITED_TASK, run, [("res", 0.5)] * LIMIT)
    c.lock_store.restart()
    ids = [*firsts, *seconds]
    states = c.wait_settled(ids, timeout=30)

    verdict = c.verdict(run, ids, states)
    report.record("semaphore: lock store restarted empty while permits are held", verdict, 1)
    executions = c.executions(run)
    news = [by_task(executions, task_id)[0] for task_id in seconds]
    # What the design cannot prevent: per slot at most the one overlap, each no longer
    # than it takes the old holder's watchdog to see its permit gone.
    assert len(verdict.violations) <= LIMIT, verdict.describe()
    rivalled = 0
    for old in (by_task(executions, e.task_id)[0] for e in olds):
        assert old.lost
        assert all(new.fence > old.fence for new in news)
        rivals = [new for new in news if new.key == old.key]
        assert all(old.believed_until - new.start <= LOCK_TTL / 3 + 0.3 for new in rivals)
        # Once a new holder wrote to its slot, the old holder's late write is refused.
        # (Both new holders may have used one slot, one after the other: then the other
        # slot saw no newer fence, and the old holder's write there is in order.)
        if rivals:
            rivalled += 1
            assert [w.applied for w in old.writes] == [True, False], old.writes
    assert rivalled >= 1
    assert all(all(w.applied for w in new.writes) for new in news)
    assert not verdict.lost, verdict.describe()
