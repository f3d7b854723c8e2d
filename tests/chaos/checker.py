"""The history checker of the chaos suite: reads what executions recorded and judges it.

An execution *believed it held a valid lock* from its start until the first of:
its end, the end of validity it last saw while the lease was valid and not
lost, and the moment it first saw the lease lost or expired. For a process
killed mid-task that is the last end of validity it recorded; for a process
frozen by SIGSTOP it is the deadline computed before it froze. The checks:

- **exclusion**: no two executions of one key overlap while both believed they
  held a valid lock. Whatever an execution did after learning that its lease
  was lost is not a violation; it is reported as a *stale holder*, and the
  fencing checks below cover its writes;
- **fence order**: per key, fences strictly increase in start order;
- **fenced writes**: the store applied each key's writes in non-decreasing
  fence order (one holder writes more than once), so a stale holder's write
  that came after a higher fence was rejected; every write it applied matches
  an execution of that key and fence; and no holder had a write rejected while
  it still believed it held the lock (someone else got a higher fence meanwhile);
- **no lost task**: every submitted id ended as executed (a success with a
  finished execution on record), skipped by policy, or failed with a stated
  reason.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from tests.chaos.history import FencedStore, execution_key, executions_key

__all__ = ["Execution", "Verdict", "Write", "check", "load_executions", "settle"]

#: Result states that count as "skipped by policy".
SKIPPED_STATES = frozenset({"SKIPPED"})


@dataclass(frozen=True)
class Write:
    """One write of an execution to the fenced store."""

    phase: str
    at: float
    applied: bool


@dataclass(frozen=True)
class Execution:
    """One execution as recorded by :class:`tests.chaos.history.ExecutionRecorder`.

    Attributes:
        id: ``<task id>:<fence>``.
        task_id: The task (or operation) id.
        key: The lock key held.
        fence: The fence of that hold.
        pid: The process that ran it.
        start: Wall-clock start.
        valid_until: The latest end of validity seen while the lease was believed valid.
        invalid_at: When it first saw its lease lost or expired, if it did.
        end: Wall-clock end; ``None`` if the process died first.
        lost: Whether ``current_lock().lost`` was set at the end.
        writes: Its fenced writes.
    """

    id: str
    task_id: str
    key: str
    fence: int
    pid: int
    start: float
    valid_until: float
    invalid_at: float | None
    end: float | None
    lost: bool
    writes: tuple[Write, ...]

    @property
    def finished(self) -> bool:
        """Whether the execution recorded its end (it was not killed)."""
        return self.end is not None

    @property
    def believed_until(self) -> float:
        """The end of the span in which it believed it held a valid lock."""
        ends = [self.valid_until]
        if self.end is not None:
            ends.append(self.end)
        if self.invalid_at is not None:
            ends.append(self.invalid_at)
        return min(ends)

    @property
    def stale(self) -> bool:
        """Whether it learned, before its end, that its lease was lost or expired."""
        return self.lost or self.invalid_at is not None

    @classmethod
    def from_hash(cls, execution_id: str, data: Mapping[bytes, bytes]) -> Execution:
        """Build it from the hash the recorder wrote."""
        text = {k.decode(): v.decode() for k, v in data.items()}
        optional = lambda name: float(text[name]) if name in text else None  # noqa: E731
        writes = tuple(Write(**w) for w in json.loads(text.get("writes", "[]")))
        return cls(
            id=execution_id,
            task_id=text["task_id"],
            key=text["key"],
            fence=int(text["fence"]),
            pid=int(text["pid"]),
            start=float(text["start"]),
            valid_until=float(text["valid_until"]),
            invalid_at=optional("invalid_at"),
            end=optional("end"),
            lost=text.get("lost") == "1",
            writes=writes,
        )


def load_executions(client: redis.Redis, run: str) -> list[Execution]:
    """Every execution recorded under ``run``, in start-record order."""
    ids = [raw.decode() for raw in client.lrange(executions_key(run), 0, -1)]
    pipe = client.pipeline(transaction=False)
    for execution_id in ids:
        pipe.hgetall(execution_key(run, execution_id))
    return [Execution.from_hash(i, data) for i, data in zip(ids, pipe.execute())]


def settle(
    submitted: Iterable[str],
    states: Mapping[str, tuple[str, Any]],
    executions: Iterable[Execution],
) -> dict[str, str]:
    """Classify each submitted id: ``executed``, ``skipped``, ``failed`` or ``lost``.

    Args:
        submitted: Every id handed to the system.
        states: id -> (state, result or meta), e.g. from ``task_states``.
        executions: The recorded executions.
    """
    finished = {e.task_id for e in executions if e.finished}
    verdicts = {}
    for task_id in submitted:
        state, info = states.get(task_id, ("PENDING", None))
        if state == "SUCCESS" and task_id in finished:
            verdicts[task_id] = "executed"
        elif state in SKIPPED_STATES and info:
            verdicts[task_id] = "skipped"
        elif state == "FAILURE" and info:
            verdicts[task_id] = "failed"
        else:
            # Never settled, or a success no execution accounts for.
            verdicts[task_id] = "lost"
    return verdicts


@dataclass
class Verdict:
    """What the checker found in one scenario run.

    Attributes:
        executions: How many executions started.
        killed: Executions that never recorded their end.
        stale: Executions that learned their lease was lost or expired.
        rejected: Writes the fenced store turned away.
        outcomes: Count per outcome of the submitted ids.
        violations: One line of evidence per broken safety property.
        lost: Ids that did not settle.
    """

    executions: int = 0
    killed: int = 0
    stale: int = 0
    rejected: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """A multi-line summary for assertion messages."""
        lines = [
            f"executions={self.executions} killed={self.killed} stale={self.stale} "
            f"rejected={self.rejected} outcomes={dict(self.outcomes)}",
            *(f"VIOLATION {line}" for line in self.violations),
            *(f"LOST {task_id}" for task_id in self.lost),
        ]
        return "\n".join(lines)


def check(
    executions: list[Execution],
    store: FencedStore,
    submitted: Iterable[str],
    states: Mapping[str, tuple[str, Any]],
) -> Verdict:
    """Run every check over one scenario run's history (see the module docstring)."""
    verdict = Verdict(executions=len(executions))
    verdict.killed = sum(not e.finished for e in executions)
    verdict.stale = sum(e.stale for e in executions)
    verdict.rejected = sum(not w.applied for e in executions for w in e.writes)
    by_key: dict[str, list[Execution]] = defaultdict(list)
    for execution in executions:
        by_key[execution.key].append(execution)
    for key, group in by_key.items():
        group.sort(key=lambda e: e.start)
        verdict.violations += _overlaps(key, group)
        verdict.violations += _fence_order(key, group)
        verdict.violations += _fenced_writes(key, group, store.applied(key))
    outcomes = settle(submitted, states, executions)
    verdict.outcomes = Counter(outcomes.values())
    verdict.lost = sorted(task_id for task_id, outcome in outcomes.items() if outcome == "lost")
    return verdict


def _overlaps(key: str, group: list[Execution]) -> list[str]:
    found = []
    for i, first in enumerate(group):
        for second in group[i + 1 :]:
            if second.start >= first.believed_until:
                continue
            found.append(
                f"{key}: {second.id} started at {second.start:.3f} while {first.id} still "
                f"believed it held the lock (until {first.believed_until:.3f}, "
                f"{first.believed_until - second.start:.3f}s of overlap)"
            )
    return found


def _fence_order(key: str, group: list[Execution]) -> list[str]:
    return [
        f"{key}: {after.id} started after {before.id} with a fence not above it"
        for before, after in zip(group, group[1:])
        if after.fence <= before.fence
    ]


def _fenced_writes(
    key: str, group: list[Execution], applied: list[tuple[int, float, str]]
) -> list[str]:
    found = []
    fences = [fence for fence, _, _ in applied]
    if any(later < earlier for earlier, later in zip(fences, fences[1:])):
        found.append(f"{key}: writes applied out of fence order: {fences}")
    known = {(e.fence, e.id) for e in group}
    for fence, _, value in applied:
        if (fence, value.rsplit("/", 1)[0]) not in known:
            found.append(f"{key}: applied write {value!r} (fence {fence}) matches no execution")
    for execution in group:
        for write in execution.writes:
            if not write.applied and write.at < execution.believed_until:
                found.append(
                    f"{key}: {execution.id} had its {write.phase} write rejected while it "
                    "still believed it held the lock"
                )
    return found
