"""Faults under real Celery workers: killed and frozen pool processes, a lock store
that freezes, forgets its scripts or restarts empty, and a broker that drops its
connections and restarts.

Every scenario runs one batch of singleton tasks (``tests.celery_apps.chaos``)
on three prefork workers, injects its fault while tasks hold their locks, waits
until every task settled, and hands the history to the checker. The tests run
in file order on one set of workers; the broker scenarios come last because they
are the only ones that disturb the workers themselves.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from tests.celery_apps.chaos import LOCK_TTL, WINDOW_TASK
from tests.celery_harness import task_states, wait_until
from tests.chaos import report
from tests.chaos.checker import Execution, Verdict
from tests.chaos.conftest import CeleryChaos
from tests.chaos.history import load_preruns
from tests.chaos.windows import Call, most_waiting, published, unaccounted

# Every scenario runs REPEATS times (the ``attempt`` fixture of conftest.py).
pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.usefixtures("attempt")]

RESOURCES = 3


def spread(calls: int, seconds: float) -> list[tuple[str, float]]:
    """``calls`` calls of ``seconds`` each, spread over :data:`RESOURCES` resources."""
    return [(f"res{i % RESOURCES}", seconds) for i in range(calls)]


def by_task(executions: Sequence[Execution], task_id: str) -> list[Execution]:
    """The executions of one task id, in start order."""
    return sorted((e for e in executions if e.task_id == task_id), key=lambda e: e.start)


def assert_safe(verdict: Verdict) -> None:
    """No exclusion or fencing violation and no lost task."""
    assert not verdict.violations, verdict.describe()
    assert not verdict.lost, verdict.describe()


@pytest.mark.timeout(60)
def test_sigkill_of_a_child_mid_task_with_acks_late(celery_chaos: CeleryChaos) -> None:
    """acks_late: killed runs are redelivered and run again once the dead holder's lock expired."""
    c = celery_chaos
    run = c.new_run()
    ids = c.submit("chaos.work", run, spread(9, 0.5))
    victims = c.wait_running(run, 2)[:2]
    for victim in victims:
        os.kill(victim.pid, signal.SIGKILL)
    states = c.wait_settled(ids, timeout=40)

    verdict = c.verdict(run, ids, states)
    report.record("SIGKILL of a worker child mid-task, acks_late", verdict, faults=len(victims))
    assert_safe(verdict)
    assert verdict.killed == len(victims)
    assert {state for state, _ in states.values()} == {"SUCCESS"}, verdict.describe()
    executions = c.executions(run)
    for victim in victims:
        first, *later = by_task(executions, victim.task_id)
        assert first.id == victim.id and later, f"{victim.task_id} did not run again"
        assert later[-1].finished and later[-1].fence > victim.fence


@pytest.mark.timeout(60)
def test_sigkill_of_a_child_mid_task_with_early_ack(celery_chaos: CeleryChaos) -> None:
    """Early ack: killed runs end FAILED with WorkerLostError (a stated reason), never lost."""
    c = celery_chaos
    run = c.new_run()
    ids = c.submit("chaos.work_early", run, spread(9, 0.5))
    victims = c.wait_running(run, 2)[:2]
    for victim in victims:
        os.kill(victim.pid, signal.SIGKILL)
    states = c.wait_settled(ids, timeout=40)

    verdict = c.verdict(run, ids, states)
    report.record("SIGKILL of a worker child mid-task, early ack", verdict, faults=len(victims))
    assert_safe(verdict)
    failed = {task_id for task_id, (state, _) in states.items() if state == "FAILURE"}
    assert failed == {victim.task_id for victim in victims}, verdict.describe()
    for task_id in failed:
        assert "WorkerLostError" in repr(states[task_id][1])
    assert verdict.outcomes == {"executed": len(ids) - len(failed), "failed": len(failed)}


#: Calls of the lock-window storm, and the pause between two of them.
STORM_CALLS = 120
STORM_GAP = 0.02


@pytest.mark.timeout(60)
def test_lock_window_storm_with_a_child_killed_mid_task(celery_chaos: CeleryChaos) -> None:
    """until_and_while_executing under a submission storm, a child SIGKILLed mid-task:
    no overlap, at most one copy per key waiting, and every call ran or was folded
    into a copy that ran."""
    c = celery_chaos
    run = c.new_run()
    task = c.app.tasks[WINDOW_TASK]
    calls: list[Call] = []
    victims: list[Execution] = []
    with c.app.producer_or_acquire() as producer:
        for i in range(STORM_CALLS):
            resource = f"res{i % 2}"
            chosen = str(uuid.uuid4())
            result = task.apply_async((run, resource, 0.4), task_id=chosen, producer=producer)
            calls.append(Call(resource, chosen, result.id, time.time()))
            if not victims and i >= STORM_CALLS // 4:
                # Mid-storm, once a copy runs: kill the pool process running
                # the copy that started last, the least likely to be ending.
                victims = sorted(c.running(run), key=lambda e: e.start)[-1:]
                for victim in victims:
                    os.kill(victim.pid, signal.SIGKILL)
            time.sleep(STORM_GAP)
    assert victims, "no copy was running mid-storm"
    copies = [call.chosen for call in published(calls)]
    states = c.wait_settled(copies, timeout=40)

    verdict = c.verdict(run, copies, states)
    report.record("lock window storm, SIGKILL of a child mid-task", verdict, faults=1)
    assert_safe(verdict)
    assert unaccounted(calls) == [], "calls folded into a copy nobody published"
    assert {state for state, _ in states.values()} == {"SUCCESS"}, verdict.describe()
    # The storm was folded: far fewer copies than calls, and never two waiting.
    assert 4 <= len(copies) <= STORM_CALLS // 3, len(copies)
    waiting = most_waiting(calls, load_preruns(c.db9, run))
    assert set(waiting.values()) == {1}, waiting
    (victim,) = victims
    first, *later = by_task(c.executions(run), victim.task_id)
    assert first.id == victim.id and not first.finished
    assert later and later[-1].finished and later[-1].fence > victim.fence


@pytest.mark.timeout(60)
def test_sigstop_of_a_holder_beyond_its_ttl(celery_chaos: CeleryChaos) -> None:
    """A holder frozen past lock_ttl learns it lost the lock, cannot release the new
    holder's lock, and its late write is rejected by the fence."""
    c = celery_chaos
    run = c.new_run()
    (first,) = c.submit("chaos.work", run, [("res", 1.0)])
    (stale,) = c.wait_running(run, 1)
    os.kill(stale.pid, signal.SIGSTOP)
    try:
        # The duplicate is requeued until the frozen holder's lock expires.
        (second,) = c.submit("chaos.work", run, [("res", 2.5)])
        wait_until(
            lambda: by_task(c.running(run), second), 20, message="the second holder to start"
        )
        lock_store = c.lock_store.client()
        assert second.encode() in (lock_store.get(stale.key) or b"")
    finally:
        os.kill(stale.pid, signal.SIGCONT)
    states = c.wait_settled([first], timeout=20)
    # The stale holder has run its release by now: the new holder's lock is intact.
    assert second.encode() in (lock_store.get(stale.key) or b""), "stale release deleted it"
    states.update(c.wait_settled([second], timeout=20))

    verdict = c.verdict(run, [first, second], states)
    report.record("SIGSTOP of a holder beyond lock_ttl, then SIGCONT", verdict, faults=1)
    assert_safe(verdict)
    old, new = by_task(c.executions(run), first)[0], by_task(c.executions(run), second)[0]
    assert old.lost, "the frozen holder never learned it lost the lock"
    assert old.believed_until <= new.start
    assert new.fence > old.fence
    assert [w.applied for w in old.writes] == [True, False], old.writes
    assert all(w.applied for w in new.writes)
    assert "was lost before the task finished" in "".join(w.log() for w in c.workers)


@pytest.mark.timeout(60)
def test_lock_store_frozen_beyond_the_ttl(celery_chaos: CeleryChaos) -> None:
    """The lock store hangs (SIGSTOP) for longer than lock_ttl: holders find out, nothing
    overlaps, nothing is lost."""
    c = celery_chaos
    run = c.new_run()
    # Holds outlast the fault, so the holders at the time are still running after it.
    ids = c.submit("chaos.work", run, spread(6, 1.5))
    holders = c.wait_running(run, 2)
    c.lock_store.pause()
    try:
        # The fault lasts until every holder saw its validity run out: > lock_ttl.
        wait_until(
            lambda: all(
                e.invalid_at is not None or e.finished
                for e in c.executions(run)
                if e.id in {h.id for h in holders}
            ),
            LOCK_TTL * 5,
            message="the holders to see their leases expire",
        )
    finally:
        c.lock_store.resume()
    states = c.wait_settled(ids, timeout=40)

    verdict = c.verdict(run, ids, states)
    report.record("lock store frozen (SIGSTOP) beyond lock_ttl", verdict, faults=1)
    assert_safe(verdict)
    assert verdict.stale >= len(holders)
    assert {state for state, _ in states.values()} == {"SUCCESS"}


@pytest.mark.timeout(60)
def test_script_flush_mid_run(celery_chaos: CeleryChaos) -> None:
    """SCRIPT FLUSH between acquisitions and renewals costs nothing: no lease is lost."""
    c = celery_chaos
    run = c.new_run()
    ids = c.submit("chaos.work", run, spread(9, 0.6))
    admin = c.lock_store.client()
    flushes = 3
    for _ in range(flushes):
        c.wait_running(run, 1)
        admin.script_flush()
        # A new acquisition after the flush (or nothing left to run).
        wait_progress(c, run)
    states = c.wait_settled(ids, timeout=40)

    verdict = c.verdict(run, ids, states)
    report.record("SCRIPT FLUSH on the lock store mid-run", verdict, faults=flushes)
    assert_safe(verdict)
    assert verdict.stale == 0, verdict.describe()
    assert {state for state, _ in states.values()} == {"SUCCESS"}


@pytest.mark.timeout(60)
def test_lock_store_restarted_empty_while_a_lock_is_held(celery_chaos: CeleryChaos) -> None:
    """Not promised: a single lock store that restarts empty forgets a held lock.

    A duplicate takes the lock at once, so two holders may run together until
    the first one's next renewal (a third of the TTL) tells it the lock is
    gone. The fence, reseeded from the server clock, is still higher, so the
    old holder's late write is rejected and the store never goes backwards.
    """
    c = celery_chaos
    run = c.new_run()
    (first,) = c.submit("chaos.work", run, [("res", 2.0)])
    (old,) = c.wait_running(run, 1)
    (second,) = c.submit("chaos.work", run, [("res", 0.5)])
    c.lock_store.restart()
    states = c.wait_settled([first, second], timeout=30)

    verdict = c.verdict(run, [first, second], states)
    report.record("lock store restarted empty while a lock is held", verdict, faults=1)
    old = by_task(c.executions(run), first)[0]
    (new,) = by_task(c.executions(run), second)
    # What the design cannot prevent: at most the one overlap, no longer than
    # it takes the old holder's watchdog to see the key gone.
    assert len(verdict.violations) <= 1, verdict.describe()
    assert old.believed_until - new.start <= LOCK_TTL / 3 + 0.3, verdict.describe()
    # How fencing contains it.
    assert old.lost
    assert new.fence > old.fence
    assert [w.applied for w in old.writes] == [True, False], old.writes
    assert all(w.applied for w in new.writes)
    assert not verdict.lost, verdict.describe()


@pytest.mark.timeout(60)
def test_broker_frozen_then_resumed(celery_chaos: CeleryChaos) -> None:
    """The broker hangs (SIGSTOP) while tasks hold locks and requeue duplicates, then
    comes back: every task still runs, one holder at a time."""
    c = celery_chaos
    run = c.new_run()
    ids = c.submit("chaos.work", run, spread(12, 0.4))
    holders = {e.id for e in c.wait_running(run, 2)}
    # Connections stay open and nothing answers while the holders finish:
    # their acks and their duplicates' requeues wait on the broker.
    c.broker.pause()
    try:
        wait_until(
            lambda: not holders & {e.id for e in c.running(run)},
            LOCK_TTL * 5,
            message="the holders at the freeze to finish",
        )
    finally:
        c.broker.resume()
    states = c.wait_settled(ids, timeout=40)

    verdict = c.verdict(run, ids, states)
    report.record("broker frozen (SIGSTOP), then resumed", verdict, faults=1)
    assert_safe(verdict)
    assert {state for state, _ in states.values()} == {"SUCCESS"}, verdict.describe()


@pytest.mark.timeout(60)
def test_broker_connections_killed(celery_chaos: CeleryChaos) -> None:
    """Every broker connection is killed mid-run: still one holder at a time.

    No loss is promised here: kombu's Redis transport takes a message off the
    queue with BRPOP and records it as unacknowledged only once the reply has
    arrived, so a connection killed in between drops that message (RabbitMQ
    requeues unacknowledged messages of a closed connection instead). A
    requeue that fails to publish while the connection is re-established is
    handed back to the broker, which the table's lost column would show.
    """
    c = celery_chaos
    run = c.new_run()
    ids = c.submit("chaos.work", run, spread(12, 0.4))
    c.wait_running(run, 2)
    # redis-py reconnects a killed connection on its next command, so the
    # workers carry on; the proof is executions starting after the kill.
    c.broker.client().client_kill_filter(_type="normal")
    wait_progress(c, run)
    states = settle_or_give_up(c, ids, timeout=15)

    verdict = c.verdict(run, ids, states)
    report.record("broker connections killed (CLIENT KILL)", verdict, faults=1)
    assert not verdict.violations, verdict.describe()
    # Anything not lost ran, or failed for a reason; nothing failed.
    assert verdict.outcomes["failed"] == 0, verdict.describe()


def settle_or_give_up(c: CeleryChaos, ids: list[str], timeout: float) -> dict[str, tuple[str, Any]]:
    """The tasks' states once all settled, or after ``timeout`` (the rest count as lost)."""
    try:
        return c.wait_settled(ids, timeout=timeout)
    except TimeoutError:
        return task_states(c.app, ids)


def wait_progress(c: CeleryChaos, run: str) -> None:
    """Wait until another execution of ``run`` starts, or none is left running."""
    started = len(c.executions(run))
    wait_until(
        lambda: progressed(c, run, started) or not c.running(run),
        30,
        message=f"progress of {run}",
    )


def progressed(c: CeleryChaos, run: str, started: int) -> bool:
    """Whether executions of ``run`` started since there were ``started`` of them."""
    return len(c.executions(run)) > started
