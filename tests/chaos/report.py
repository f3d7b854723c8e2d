"""The chaos suite's summary table: one row per scenario, printed and written to the docs.

Scenario tests call :func:`record` with their :class:`~tests.chaos.checker.Verdict`;
the terminal-summary hook in ``tests/chaos/conftest.py`` prints the table and,
when every scenario ran, puts it into ``docs/chaos.md`` between two markers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.checker import Verdict

__all__ = ["DOC", "SCENARIOS", "Row", "record", "render", "rows", "update_doc"]

DOC = Path(__file__).resolve().parents[2] / "docs" / "chaos.md"
_START = "<!-- chaos-table:start -->"
_END = "<!-- chaos-table:end -->"

#: Every scenario, in table order, with what the design promises under it.
SCENARIOS: dict[str, str] = {
    "SIGKILL of a worker child mid-task, acks_late": "safe, no loss",
    "SIGKILL of a worker child mid-task, early ack": "safe; killed runs fail (WorkerLostError)",
    "lock window storm, SIGKILL of a child mid-task": (
        "safe, no loss; at most one copy per key waiting"
    ),
    "SIGSTOP of a holder beyond lock_ttl, then SIGCONT": "safe, no loss",
    "lock store frozen (SIGSTOP) beyond lock_ttl": "safe, no loss",
    "SCRIPT FLUSH on the lock store mid-run": "safe, no loss",
    "lock store restarted empty while a lock is held": "NOT promised; fencing contains it",
    "semaphore: SIGSTOP of a permit holder beyond lock_ttl": "safe per slot, no loss",
    "semaphore: lock store frozen (SIGSTOP) beyond lock_ttl": "safe per slot, no loss",
    "semaphore: lock store restarted empty while permits are held": (
        "NOT promised; fencing per slot contains it"
    ),
    "broker frozen (SIGSTOP), then resumed": "safe, no loss",
    "broker connections killed (CLIENT KILL)": "safe; loss not promised (Redis transport)",
    "Redlock, 5 masters: minority killed, hung, restarted empty": (
        "safe, no loss (at most 2 of 5 faulty; restart rule)"
    ),
    "Redlock, 5 masters: one restarted empty at once (rule broken)": (
        "NOT promised; fencing contains it"
    ),
    "Sentinel lock store: planned failover (SENTINEL FAILOVER)": (
        "safe, no loss (redlock_min_replicas 'auto': 1)"
    ),
}


@dataclass
class Row:
    """The totals of one scenario over its runs."""

    scenario: str
    runs: int = 0
    faults: int = 0
    executions: int = 0
    violations: int = 0
    lost: int = 0
    stale: int = 0
    rejected: int = 0


_rows: dict[str, Row] = {}


def record(scenario: str, verdict: Verdict, faults: int) -> None:
    """Add one run of ``scenario`` (a key of :data:`SCENARIOS`) to the table."""
    if scenario not in SCENARIOS:
        raise KeyError(f"unknown chaos scenario {scenario!r}")
    row = _rows.setdefault(scenario, Row(scenario))
    row.runs += 1
    row.faults += faults
    row.executions += verdict.executions
    row.violations += len(verdict.violations)
    row.lost += len(verdict.lost)
    row.stale += verdict.stale
    row.rejected += verdict.rejected


def rows() -> list[Row]:
    """The rows recorded so far, in table order."""
    return [_rows[name] for name in SCENARIOS if name in _rows]


def render(table: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| scenario | runs | faults | executions | violations | lost | stale holders "
        "| rejected writes | promise |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in table:
        lines.append(
            f"| {row.scenario} | {row.runs} | {row.faults} | {row.executions} | "
            f"{row.violations} | {row.lost} | {row.stale} | {row.rejected} | "
            f"{SCENARIOS[row.scenario]} |"
        )
    return "\n".join(lines)


def update_doc(table: list[Row], stamp: str, path: Path = DOC) -> bool:
    """Replace the table between the markers of ``path``; return whether it was written.

    Only a complete table is written: a partial run (``-k``) leaves the docs alone.
    """
    if [row.scenario for row in table] != list(SCENARIOS) or not path.exists():
        return False
    text = path.read_text()
    block = f"{_START}\n{stamp}\n\n{render(table)}\n{_END}"
    updated, count = re.subn(
        rf"{re.escape(_START)}.*?{re.escape(_END)}", lambda _: block, text, flags=re.S
    )
    if count != 1:
        return False
    path.write_text(updated)
    return True
