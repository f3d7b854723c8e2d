"""The fair-requeue soak: calls on a few keys under random SIGKILL/SIGSTOP, and its wait bound.

Shared by tests/chaos/test_fair_requeue.py (short) and bench/fairness_soak.py
(150 s, old behaviour beside the new). Calls are sent over ``spread`` seconds
with random durations; a fault thread picks a running execution of the run
at random and SIGKILLs its pool process (acks_late redelivers it) or
SIGSTOPs it past the lock's TTL and lets it go on.

The wait of a call is from its send to the start of its successful
execution. The bound docs/conflicts.md states, checked per call:

    wait <= 2 * W / limit + F * (ttl + worker_lost_wait + 1 s) + SLACK

``W``: the work (seconds held) of executions of calls sent *before* it that
ran while it waited; ``F``: faults injected while it waited; ``SLACK``: the
polls and deliveries of one requeue. A call overtaken by calls sent after it
waits for work that ``W`` does not count. :meth:`Soak.overtaken` counts such
calls directly: the sharper sign of unfairness in a short run.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tests.celery_apps.chaos import LOCK_TTL
from tests.chaos.checker import Execution, Verdict
from tests.chaos.conftest import CeleryChaos

__all__ = ["SLACK", "Soak", "most_believing", "run_soak"]

#: Seconds of polls and deliveries a call may add to the bound.
SLACK = 2.0
#: What one fault may cost the calls behind it: the lease's TTL, the worker
#: noticing its lost process (worker_lost_wait), and a redelivery.
FAULT_COST = LOCK_TTL + 1.0 + 1.0


@dataclass
class Soak:
    """What one soak sent, what it recorded, and its waits."""

    limit: int
    sent: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    faults: list[float] = field(default_factory=list)
    executions: list[Execution] = field(default_factory=list)
    verdict: Verdict | None = None
    waits: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)

    def over_bound(self) -> dict[str, tuple[float, float]]:
        """Calls whose wait exceeded their bound: id -> (wait, bound)."""
        return {
            task_id: (wait, self.bounds[task_id])
            for task_id, wait in self.waits.items()
            if wait > self.bounds[task_id]
        }

    def overtaken(self, margin: float = 1.0) -> int:
        """Calls that some call sent ``margin`` seconds or more after them started before."""
        starts = {
            e.task_id: e.start for e in self.executions if e.finished and e.task_id in self.waits
        }
        count = 0
        for task_id, began in starts.items():
            resource, sent_at, _ = self.sent[task_id]
            count += any(
                self.sent[other][0] == resource
                and self.sent[other][1] >= sent_at + margin
                and other_start < began
                for other, other_start in starts.items()
            )
        return count

    @property
    def longest(self) -> float:
        """The longest wait of any call."""
        return max(self.waits.values(), default=0.0)


def most_believing(executions: Sequence[Execution]) -> dict[str, int]:
    """Per key, the most executions that believed at one instant that they held it."""
    spans: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for execution in executions:
        key = execution.key.rsplit("#", 1)[0]
        spans[key] += [(execution.start, 1), (execution.believed_until, -1)]
    most: dict[str, int] = {}
    for key, events in spans.items():
        inside = most[key] = 0
        for _, step in sorted(events):
            inside += step
            most[key] = max(most[key], inside)
    return most


def _faults(c: CeleryChaos, run: str, stop: threading.Event, every: float, soak: Soak) -> None:
    chooser = random.Random(7)
    while not stop.wait(every * (0.5 + chooser.random())):
        running = c.running(run)
        if not running:
            continue
        victim = chooser.choice(running)
        soak.faults.append(time.time())
        try:
            if chooser.random() < 0.5:
                os.kill(victim.pid, signal.SIGKILL)
            else:
                os.kill(victim.pid, signal.SIGSTOP)
                time.sleep(LOCK_TTL * 1.5)
                os.kill(victim.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def run_soak(
    c: CeleryChaos,
    task_name: str,
    limit: int,
    *,
    calls: int,
    keys: int,
    spread: float,
    durations: tuple[float, float],
    fault_every: float,
    timeout: float,
    seed: int = 1,
) -> Soak:
    """Send ``calls`` calls over ``spread`` seconds with faults; wait until all settle."""
    run = c.new_run()
    chooser = random.Random(seed)
    soak = Soak(limit)
    stop = threading.Event()
    faults = threading.Thread(target=_faults, args=(c, run, stop, fault_every, soak), daemon=True)
    faults.start()
    try:
        started = time.monotonic()
        for i in range(calls):
            resource = f"k{chooser.randrange(keys)}"
            seconds = round(chooser.uniform(*durations), 3)
            (task_id,) = c.submit(task_name, run, [(resource, seconds)])
            soak.sent[task_id] = (resource, time.time(), seconds)
            pause = started + spread * (i + 1) / calls - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        states = c.wait_settled(list(soak.sent), timeout=timeout)
    finally:
        stop.set()
        faults.join(10)
    soak.executions = c.executions(run)
    soak.verdict = c.verdict(run, list(soak.sent), states)
    _measure(soak)
    return soak


def _measure(soak: Soak) -> None:
    ran: dict[str, Execution] = {}
    for execution in soak.executions:
        if execution.finished and execution.task_id in soak.sent:
            ran[execution.task_id] = execution
    for task_id, (resource, sent_at, _) in soak.sent.items():
        execution = ran.get(task_id)
        if execution is None:
            continue
        began = execution.start
        work = sum(
            min(other.end or other.believed_until, began) - max(other.start, sent_at)
            for other in soak.executions
            if other.task_id != task_id
            and other.task_id in soak.sent
            and soak.sent[other.task_id][0] == resource
            and soak.sent[other.task_id][1] < sent_at
            and other.start < began
            and (other.end or other.believed_until) > sent_at
        )
        faults = sum(sent_at <= at <= began for at in soak.faults)
        soak.waits[task_id] = began - sent_at
        soak.bounds[task_id] = 2 * work / soak.limit + faults * FAULT_COST + SLACK
