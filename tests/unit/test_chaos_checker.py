"""The chaos suite's history checker finds each kind of violation it is meant to find."""

from __future__ import annotations

from typing import Any

from tests.chaos.checker import Execution, Write, check, settle

KEY = "k"


class Applied:
    """The applied-write log of the fenced store, given directly."""

    def __init__(self, entries: list[tuple[int, float, str]]) -> None:
        self.entries = entries

    def applied(self, resource: str) -> list[tuple[int, float, str]]:
        return self.entries if resource == KEY else []


def execution(
    task_id: str,
    fence: int,
    start: float,
    end: float | None,
    *,
    valid_until: float | None = None,
    invalid_at: float | None = None,
    lost: bool = False,
    writes: tuple[Write, ...] = (),
) -> Execution:
    return Execution(
        id=f"{task_id}:{fence}",
        task_id=task_id,
        key=KEY,
        fence=fence,
        pid=1,
        start=start,
        valid_until=valid_until if valid_until is not None else (end or start) + 1,
        invalid_at=invalid_at,
        end=end,
        lost=lost,
        writes=writes,
    )


def applied_log(*executions: Execution) -> Applied:
    entries = [
        (e.fence, w.at, f"{e.id}/{w.phase}") for e in executions for w in e.writes if w.applied
    ]
    return Applied(sorted(entries, key=lambda entry: entry[1]))


def run_check(executions: list[Execution], store: Any = None) -> list[str]:
    ids = [e.task_id for e in executions]
    states = {task_id: ("SUCCESS", task_id) for task_id in ids}
    verdict = check(executions, store or applied_log(*executions), ids, states)
    return verdict.violations


def test_one_holder_after_another_is_clean() -> None:
    """Serial holds with rising fences and in-order writes: no violation."""
    first = execution("a", 10, 0.0, 1.0, writes=(Write("first", 0.1, True),))
    second = execution("b", 11, 1.5, 2.0, writes=(Write("first", 1.6, True),))
    assert run_check([first, second]) == []


def test_overlap_while_both_believed_valid_is_a_violation() -> None:
    """A second holder starting while the first still believed its lease valid is caught."""
    first = execution("a", 10, 0.0, 2.0)
    second = execution("b", 11, 1.0, 3.0)
    (violation,) = run_check([first, second])
    assert "still believed it held the lock" in violation


def test_overlap_after_the_holder_learned_of_the_loss_is_not() -> None:
    """What a holder does after seeing its lease expire is not counted as an overlap."""
    stale = execution("a", 10, 0.0, 3.0, valid_until=0.9, invalid_at=2.5, lost=True)
    newer = execution("b", 11, 1.0, 2.0)
    assert run_check([stale, newer]) == []


def test_a_killed_holder_counts_until_its_last_known_validity() -> None:
    """A SIGKILLed execution (no end) blocks others until the validity it last saw."""
    killed = execution("a", 10, 0.0, None, valid_until=1.5)
    early = execution("b", 11, 1.2, 2.0)
    assert len(run_check([killed, early])) == 1
    late = execution("c", 11, 1.6, 2.0)
    assert run_check([killed, late]) == []


def test_fences_must_rise_in_start_order() -> None:
    """A later holder with a lower fence is caught."""
    first = execution("a", 11, 0.0, 1.0)
    second = execution("b", 10, 1.5, 2.0)
    (violation,) = run_check([first, second])
    assert "fence not above" in violation


def test_writes_applied_out_of_fence_order_are_caught() -> None:
    """A store that applied a lower fence after a higher one is caught."""
    first = execution("a", 10, 0.0, 1.0, writes=(Write("last", 0.9, True),))
    second = execution("b", 11, 1.5, 2.0, writes=(Write("first", 1.6, True),))
    store = Applied([(11, 1.6, "b:11/first"), (10, 0.9, "a:10/last")])
    assert any("out of fence order" in v for v in run_check([first, second], store))


def test_a_rejected_write_while_believed_valid_is_a_violation() -> None:
    """A holder whose write bounced while it thought it held the lock is caught."""
    holder = execution("a", 10, 0.0, 1.0, writes=(Write("last", 0.9, False),))
    (violation,) = run_check([holder], Applied([]))
    assert "rejected while it still believed" in violation


def test_a_stale_holders_rejected_write_is_fine() -> None:
    """The fence turning away a stale holder's late write is what it is for."""
    stale = execution(
        "a", 10, 0.0, 3.0, valid_until=0.9, invalid_at=2.5, writes=(Write("last", 2.6, False),)
    )
    newer = execution("b", 11, 1.0, 2.0, writes=(Write("first", 1.1, True),))
    assert run_check([stale, newer]) == []


def test_settle_classifies_every_submitted_id() -> None:
    """Executed, skipped and failed ids settle; a success without an execution is lost."""
    ran = execution("a", 10, 0.0, 1.0)
    states = {
        "a": ("SUCCESS", "a"),
        "b": ("SKIPPED", {"reason": "duplicate"}),
        "c": ("FAILURE", "WorkerLostError()"),
        "d": ("SUCCESS", "d"),
    }
    verdicts = settle(["a", "b", "c", "d", "e"], states, [ran])
    assert verdicts == {
        "a": "executed",
        "b": "skipped",
        "c": "failed",
        "d": "lost",
        "e": "lost",
    }
