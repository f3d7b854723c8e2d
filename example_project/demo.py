"""The demo driver: duplicate storms against a real Celery worker, then a summary.

Run it with ``scripts/demo`` (or ``python -m example_project.demo`` from the
repository root). It finds or starts a Redis (see :mod:`example_project.local_redis`),
starts a prefork worker, and plays eight scenarios. The first five lock while
the task runs (``while_executing``, the default); the last three lock from
``apply_async`` on (the lock windows of docs/modes.md):

1. skip: 20 calls of ``sync_invoices(42)``; one runs, 19 are skipped.
2. requeue: 5 calls of ``rebuild_report(7)``; all run, one after another.
3. fencing: ``charge_card(99, ...)`` and a lock holder that stalls past its TTL;
   the ledger refuses the stale holder's write.
4. per-queue locking by configuration: 5 calls of the plain ``export_statement(7)``
   on the queue the app's ``redlock_queues`` locks (requeue: all run, one at a time).
5. per-queue locking by worker option: 10 calls of the plain ``send_reminder(42)``
   on the queue the worker's ``--redlock-queues`` locks (skip: one runs).
6. until_executed: 20 clicks of ``nightly_report(day)``; one task id, one run.
7. until_executing + raise: 10 debounced ``refresh_rates("EUR")`` requests;
   one published, 9 ``DuplicateTask``; a request after it started is published.
8. until_and_while_executing: a storm of 20 ``sync_catalog(5)`` calls while one
   runs; at most one running and one queued, two runs in all.

It exits 0 when every expectation holds, 1 when one fails, 2 when no Redis
could be found, or ``$REDIS_URL`` is not a Redis URL or does not answer.
Whatever happens, it stops the worker (and a Redis it started) by pid and
deletes this run's keys, and only those.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

from celery_redlock import SKIPPED, DuplicateTask, Lock
from celery_redlock.core.keys import KeyBuilder

from .journal import Run, read_events, read_runs, running_key, server_time
from .ledger import balance, record_charge
from .local_redis import LocalRedis, NoRedisError, redacted, with_db
from .worker import Worker

#: The database of the demo's Redis that holds all its keys.
DB = 12
#: Every wait together must end within this many seconds of the start.
TIME_BUDGET = 50.0
#: How long the stale holder of scenario 3 keeps its lock without renewing it.
STALE_TTL = 0.5
#: The debounce delay of scenario 7: refresh_rates is sent with this countdown.
RATES_COUNTDOWN = 1.0

SETTLED = {"SUCCESS", "FAILURE", "REVOKED", SKIPPED}


class DemoFailure(Exception):
    """Something the demo waited for did not happen."""


class Progress:
    """One status line: rewritten in place on a terminal, printed when done elsewhere.

    Off a terminal (CI logs, pytest) a long wait still prints a line every 5 s.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.tty = sys.stdout.isatty()
        self._printed_at = time.monotonic()

    def update(self, text: str) -> None:
        if self.tty:
            sys.stdout.write(f"\r\033[K{self.label} {text}")
            sys.stdout.flush()
        elif time.monotonic() - self._printed_at >= 5:
            print(f"{self.label} {text}", flush=True)
            self._printed_at = time.monotonic()

    def done(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(f"{self.label} {text}", flush=True)


@dataclass
class Check:
    ok: bool
    text: str


@dataclass
class Step:
    """What one scenario sent, and what became of it."""

    label: str
    policy: str
    locked_by: str
    ids: list[str]
    t0: float  # Redis clock when the first call was sent
    began: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    states: dict[str, str] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    requeues: int = 0
    mode: str = "while_executing"
    on_duplicate: str = "-"
    same_id: int = 0  # calls apply_async answered with an earlier call's task id
    raised: int = 0  # calls apply_async refused with DuplicateTask

    @property
    def sent(self) -> int:
        """Calls made: those published (``ids``) and those deduplicated at publish."""
        return len(self.ids) + self.same_id + self.raised

    def count(self, state: str) -> int:
        return sum(1 for value in self.states.values() if value == state)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str) -> list[str]:
    """Format rows under a header; ``align`` holds one ``<`` or ``>`` per column."""
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        "  ".join(
            cell.ljust(width) if side == "<" else cell.rjust(width)
            for cell, width, side in zip(row, widths, align)
        ).rstrip()
        for row in cells
    ]


@contextlib.contextmanager
def uninterruptible() -> Iterator[None]:
    """Ignore Ctrl-C while cleaning up, so a second one cannot leave a worker behind."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def delete_keys(client: redis.Redis, prefix: str) -> int:
    """Delete every key under ``prefix`` (SCAN, never KEYS); return how many."""
    deleted = 0
    batch: list[str] = []
    for key in client.scan_iter(match=f"{prefix}:*", count=500):
        batch.append(key)
        if len(batch) == 500:
            deleted += client.delete(*batch)
            batch.clear()
    if batch:
        deleted += client.delete(*batch)
    return deleted


class Demo:
    """The scenarios, run against one worker.

    Args:
        client: A client of the demo's database (``decode_responses=True``).
        prefix: This run's key prefix.
        tasks: The imported :mod:`example_project.tasks`.
        worker: The running worker.
        deadline: ``time.monotonic()`` value by which every wait must be over.
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        tasks: ModuleType,
        worker: Worker,
        deadline: float,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.tasks = tasks
        self.app = tasks.app
        self.worker = worker
        self.deadline = deadline
        self.checks: list[Check] = []
        self.fencing_lines: list[str] = []
        self.window_lines: list[str] = []

    # -- waiting ---------------------------------------------------------------------

    def wait_for(self, label: str, poll: Callable[[], tuple[bool, str]], timeout: float) -> float:
        """Poll until ``poll()`` says done, showing its status; return the seconds waited.

        Raises:
            DemoFailure: On timeout, or if the worker exits meanwhile.
        """
        progress = Progress(label)
        began = time.monotonic()
        limit = min(began + timeout, self.deadline)
        while True:
            done, status = poll()
            now = time.monotonic()
            if done:
                progress.done(f"{status} ({now - began:.1f} s)")
                return now - began
            code = self.worker.exit_code()
            if code is not None:
                progress.done(f"{status}: the worker exited")
                raise DemoFailure(f"the worker exited with code {code} during: {label.strip()}")
            if now >= limit:
                progress.done(f"{status}: gave up after {now - began:.0f} s")
                raise DemoFailure(f"timed out after {now - began:.0f} s: {label.strip()}")
            progress.update(f"{status} ({now - began:.1f} s)")
            time.sleep(0.05)

    def wait_for_key(self, label: str, key: str, states: tuple[str, str], timeout: float) -> None:
        """Wait until ``key`` exists; ``states`` are the statuses shown before and after."""

        def poll() -> tuple[bool, str]:
            exists = bool(self.client.exists(key))
            return exists, states[exists]

        self.wait_for(label, poll, timeout)

    def states(self, ids: Sequence[str]) -> dict[str, str]:
        return {task_id: self.app.AsyncResult(task_id).state for task_id in ids}

    def wait_settled(self, step: Step, label: str, timeout: float) -> None:
        def poll() -> tuple[bool, str]:
            step.states = self.states(step.ids)
            done = sum(1 for state in step.states.values() if state in SETTLED)
            requeues = self.requeues(step.ids)
            parts = [f"{step.count('SUCCESS')} ran"]
            if step.policy == "skip":
                parts.append(f"{step.count(SKIPPED)} skipped")
            else:
                parts.append(f"{requeues} requeues")
            parts.append(f"{len(step.ids) - done} waiting")
            return done == len(step.ids), ", ".join(parts)

        self.wait_settled_with(step, label, poll, timeout)

    def wait_settled_with(
        self, step: Step, label: str, poll: Callable[[], tuple[bool, str]], timeout: float
    ) -> None:
        """Wait with ``poll``, then collect the step's time, runs and requeues."""
        self.wait_for(label, poll, timeout)
        step.seconds = time.monotonic() - step.began
        ids = set(step.ids)
        step.runs = [run for run in read_runs(self.client, self.prefix) if run.task_id in ids]
        step.requeues = self.requeues(step.ids)

    def requeues(self, ids: Sequence[str]) -> int:
        wanted = set(ids)
        return sum(
            1
            for event in read_events(self.client, self.prefix)
            if event["action"] == "requeue" and event["task_id"] in wanted
        )

    def check(self, ok: bool, expected: str, got: str = "") -> None:
        """Record an expectation; what was seen instead is shown only if it failed."""
        self.checks.append(Check(ok, expected if ok or not got else f"{expected}; got {got}"))

    # -- scenarios -------------------------------------------------------------------

    def lock_key(self, task: Any, *args: Any) -> str:
        """The lock key a call takes, for plain tasks too (they have no ``lock_key_for``)."""
        prefix = self.app.conf.redlock_key_prefix
        return str(KeyBuilder(task.name, task.run, None, prefix).key_for(args, {}))

    def skip_storm(self, task: Any, arg: int, total: int, locked_by: str) -> Step:
        """Send one call, and ``total - 1`` more while it holds its lock; one must run."""
        name = f"{task.name.rsplit('.', 1)[-1]}({arg})"
        step = Step(name, "skip", locked_by, [], server_time(self.client))
        first = task.delay(arg)
        step.ids.append(first.id)
        key = self.lock_key(task, arg)
        self.wait_for_key("   first call takes its lock ...", key, ("waiting", "held"), timeout=15)
        step.ids += [task.delay(arg).id for _ in range(total - 1)]
        self.wait_settled(step, f"   {total} calls settle ...", timeout=15)

        runner = [run.task_id for run in step.runs]
        metas = [self.app.AsyncResult(i).info for i in step.ids[1:]]
        holders = {meta.get("holder") if isinstance(meta, dict) else None for meta in metas}
        self.check(
            runner == [first.id] and step.states[first.id] == "SUCCESS",
            f"{name}: exactly 1 of {total} ran",
            f"{len(runner)} runs, first call {step.states[first.id]}",
        )
        self.check(
            step.count(SKIPPED) == total - 1 and holders == {first.id},
            f"{name}: the other {total - 1} were SKIPPED, naming the running call as holder",
            f"{step.count(SKIPPED)} skipped, holders {sorted(map(str, holders))}",
        )
        return step

    def requeue_storm(self, task: Any, arg: int, total: int, locked_by: str) -> Step:
        """Send ``total`` calls at once; all must run, one at a time, fences rising."""
        name = f"{task.name.rsplit('.', 1)[-1]}({arg})"
        step = Step(name, "requeue", locked_by, [], server_time(self.client))
        step.ids += [task.delay(arg).id for _ in range(total)]
        self.wait_settled(step, f"   {total} calls run in turn ...", timeout=20)

        runs = step.runs
        fences = [run.fence or 0 for run in runs]  # a locked run always has a fence
        overlaps = [
            f"{a.task_id[:8]}/{b.task_id[:8]}" for a, b in zip(runs, runs[1:]) if b.start < a.end
        ]
        self.check(
            step.count("SUCCESS") == total and sorted(r.task_id for r in runs) == sorted(step.ids),
            f"{name}: all {total} ran, each once",
            f"{len(runs)} runs, {step.count('SUCCESS')} succeeded",
        )
        self.check(
            not overlaps and all(run.holders == 1 for run in runs),
            f"{name}: one at a time, no overlap",
            f"overlapping: {', '.join(overlaps) or 'by the running counter'}",
        )
        self.check(
            all(a < b for a, b in zip(fences, fences[1:])),
            f"{name}: fences increase in run order",
            str(fences),
        )
        return step

    def queues_locked(self, config_queue: str, cli_queue: str) -> None:
        """Check the worker's start-up line: it locks both queues, from both sources."""
        line = next(
            (x for x in self.worker.log_tail(400).splitlines() if "locking tasks from" in x), ""
        )
        self.check(
            config_queue in line and cli_queue in line,
            f"the worker locks {config_queue} (redlock_queues) and {cli_queue} (--redlock-queues)",
            repr(line.strip()) if line else "no 'locking tasks from' line in its log",
        )

    def fencing(self) -> Step:
        charge = self.tasks.charge_card
        say = self.fencing_lines.append
        print("\n3. fencing: charge_card(99, ...) and a lock holder that stalls past its TTL")
        step = Step(
            "charge_card(99, ...)", "requeue", "SingletonTask", [], server_time(self.client)
        )
        first = charge.delay(99, 25)
        step.ids.append(first.id)
        self.wait_settled(step, "   charge_card(99, 25) ...", timeout=15)
        one = first.result if step.states[first.id] == "SUCCESS" else {}
        say(f"charge_card(99, 25)   fence {one.get('fence')}  accepted={one.get('accepted')}")

        # The stale holder: a process that took charge_card(99)'s lock to book 40,
        # then froze (a GC pause, SIGSTOP, a VM migration) before writing. It uses
        # the library's own lock, without renewal, so the lock expires under it.
        stale = Lock(self.client, charge.lock_key_for(99, 40), timeout=STALE_TTL)
        if not stale.acquire(blocking=False):
            raise DemoFailure("the stale holder could not take charge_card(99)'s lock")
        stale_fence = stale.fence
        say(f"stale holder          fence {stale_fence}  took the lock, froze (TTL {STALE_TTL} s)")

        # The charge is retried, as a queue would redeliver it; it waits out the lock.
        second = charge.delay(99, 40)
        step.ids.append(second.id)
        self.wait_settled(step, "   charge_card(99, 40) while it is frozen ...", timeout=15)
        two = second.result if step.states[second.id] == "SUCCESS" else {}
        requeues = self.requeues([second.id])
        waited = (
            f"requeued {requeues} x until the stale lock expired"
            if requeues
            else "the stale lock had expired before it arrived"
        )
        say(f"charge_card(99, 40)   fence {two.get('fence')}  accepted={two.get('accepted')}")
        say(f"                      ({waited})")

        # The frozen holder wakes up and books its 40, with the fence it was given.
        write = record_charge(self.client, self.prefix, 99, 40, fence=stale_fence, writer="stale")
        say(
            f"stale holder wakes    fence {stale_fence}  accepted={write.accepted}"
            f"  (the ledger has seen fence {write.fence})"
        )
        total = balance(self.client, self.prefix, 99)
        say(f"ledger balance of account 99: {total} (25 + 40; the stale 40 was not booked twice)")

        self.check(
            bool(one.get("accepted")) and bool(two.get("accepted")),
            "charge_card(99): both charges booked",
            f"{one or 'no result'} / {two or 'no result'}",
        )
        self.check(
            not write.accepted and two.get("fence", 0) > stale_fence > one.get("fence", 0),
            "charge_card(99): the stale holder's write, with its older fence, was refused",
            f"accepted={write.accepted}, fences {one.get('fence')} < {stale_fence} "
            f"< {two.get('fence')}?",
        )
        self.check(total == 65, "charge_card(99): balance is 65, not 105", str(total))
        return step

    # -- lock windows ----------------------------------------------------------------

    def until_executed_clicks(self, day: str, clicks: int) -> Step:
        """``clicks`` calls of the day's report: one is published, the rest get its id."""
        task = self.tasks.nightly_report
        name = f"nightly_report({day})"
        step = Step(name, "skip", "SingletonTask", [], server_time(self.client))
        step.mode, step.on_duplicate = "until_executed", "return_existing"
        returned = [task.delay(day).id for _ in range(clicks)]
        step.ids = sorted(set(returned), key=returned.index)
        step.same_id = clicks - len(step.ids)
        print(f"   {clicks} clicks ... {len(step.ids)} published, {step.same_id} got its task id")
        self.window_lines.append(
            f"{name}: {clicks} clicks of 'generate' returned "
            f"{len(step.ids)} distinct task id: {', '.join(i[:8] for i in step.ids)}"
        )
        self.wait_settled(step, "   the report runs ...", timeout=15)
        self.check(
            len(step.ids) == 1 and step.same_id == clicks - 1,
            f"{name}: {clicks} clicks, 1 published; the other {clicks - 1} got its task id",
            f"{len(step.ids)} published",
        )
        self.check(
            len(step.runs) == 1 and step.count("SUCCESS") == len(step.ids),
            f"{name}: the report was generated once",
            f"{len(step.runs)} runs",
        )
        return step

    def until_executing_debounce(self, currency: str, requests: int) -> Step:
        """Debounced requests fold into one queued refresh; one after it starts queues anew."""
        task = self.tasks.refresh_rates
        name = f"refresh_rates({currency})"
        step = Step(name, "skip", "SingletonTask", [], server_time(self.client))
        step.mode, step.on_duplicate = "until_executing", "raise"
        first = task.apply_async((currency,), countdown=RATES_COUNTDOWN)
        step.ids.append(first.id)
        refused: list[DuplicateTask] = []
        for _ in range(requests - 1):
            try:
                step.ids.append(task.apply_async((currency,), countdown=RATES_COUNTDOWN).id)
            except DuplicateTask as exc:
                refused.append(exc)
        step.raised = len(refused)
        print(f"   {requests} requests ... {len(step.ids)} published, {step.raised} DuplicateTask")
        ttls = [exc.holder_ttl for exc in refused if exc.holder_ttl is not None]
        holders = {exc.task_id for exc in refused}
        if ttls:
            self.window_lines.append(
                f"{name}: {len(refused)} requests raised DuplicateTask naming "
                f"{', '.join(sorted(str(h)[:8] for h in holders))}, whose reservation had "
                f"{min(ttls):.0f} s left (countdown + lock_enqueue_ttl)"
            )
        # Its reservation ends when a worker starts it (after the countdown).
        reserved = f"{task.lock_key_for(currency)}:queued"
        running = running_key(self.prefix, task.lock_key_for(currency))

        def started() -> tuple[bool, str]:
            begun = not self.client.exists(reserved) and bool(self.client.get(running))
            return begun, "running" if begun else "queued, counting down"

        self.wait_for(f"   the refresh starts after its {RATES_COUNTDOWN:.0f} s countdown ...",
                      started, timeout=15)  # fmt: skip
        try:
            later = task.delay(currency)
            step.ids.append(later.id)
            self.window_lines.append(
                f"{name}: a request after it started was published ({later.id[:8]})"
            )
        except DuplicateTask as exc:
            step.raised += 1
            self.window_lines.append(f"{name}: a request after it started was refused: {exc}")
        self.wait_settled(step, "   both refreshes run ...", timeout=15)
        self.check(
            step.raised == requests - 1 and holders == {first.id},
            f"{name}: {requests - 1} of {requests} requests in the countdown raised "
            "DuplicateTask naming the queued one",
            f"{step.raised} raised, holders {sorted(map(str, holders))}",
        )
        self.check(
            len(step.ids) == 2 and len(step.runs) == 2 and step.count("SUCCESS") == 2,
            f"{name}: the request made after it started was published and ran",
            f"{len(step.ids)} published, {len(step.runs)} runs",
        )
        return step

    def until_and_while_storm(self, shop_id: int, calls: int) -> Step:
        """A storm while one sync runs: one more is queued, the rest get the queued one's id."""
        task = self.tasks.sync_catalog
        name = f"sync_catalog({shop_id})"
        step = Step(name, "requeue", "SingletonTask", [], server_time(self.client))
        step.mode, step.on_duplicate = "until_and_while_executing", "return_existing"
        key = task.lock_key_for(shop_id)
        running, queued = running_key(self.prefix, key), f"{key}:queued"
        peak = {"running": 0, "queued": 0, "samples": 0}

        def sample() -> tuple[int, int]:
            now_running = int(self.client.get(running) or 0)
            now_queued = int(self.client.exists(queued))
            peak["running"] = max(peak["running"], now_running)
            peak["queued"] = max(peak["queued"], now_queued)
            peak["samples"] += 1
            return now_running, now_queued

        def first_runs() -> tuple[bool, str]:
            now_running, _ = sample()
            return now_running > 0, "running" if now_running else "queued"

        returned = [task.delay(shop_id).id]
        self.wait_for("   the first sync starts ...", first_runs, timeout=15)
        progress = Progress(f"   {calls - 1} more calls while it runs ...")
        for n in range(calls - 1):
            returned.append(task.delay(shop_id).id)
            now_running, now_queued = sample()
            progress.update(f"{n + 1} sent: {now_running} running, {now_queued} queued")
            time.sleep(0.01)  # a storm of webhooks, not one burst (all within the first run)
        step.ids = sorted(set(returned), key=returned.index)
        step.same_id = calls - len(step.ids)
        progress.done(f"{len(step.ids)} published, {step.same_id} got the queued one's id")

        def poll() -> tuple[bool, str]:
            now_running, now_queued = sample()
            step.states = self.states(step.ids)
            done = sum(1 for state in step.states.values() if state in SETTLED)
            status = (
                f"{now_running} running, {now_queued} queued, {step.count('SUCCESS')} done, "
                f"{self.requeues(step.ids)} requeues"
            )
            return done == len(step.ids), status

        self.wait_settled_with(step, f"   {len(step.ids)} published syncs run ...", poll, 15)
        self.window_lines.append(
            f"{name}: {calls} calls; at most {peak['running']} running and {peak['queued']} "
            f"queued in {peak['samples']} samples; {step.same_id} got task id "
            f"{step.ids[-1][:8]}, the queued one"
        )
        runs = step.runs
        fences = [run.fence or 0 for run in runs]
        self.check(
            len(step.ids) == 2 and step.same_id == calls - 2,
            f"{name}: {calls} calls, 2 published (one running, one queued); "
            f"{calls - 2} got the queued one's id",
            f"{len(step.ids)} published",
        )
        self.check(
            peak["running"] == 1 and peak["queued"] == 1 and all(r.holders == 1 for r in runs),
            f"{name}: never more than 1 running and 1 queued",
            f"peaks {peak['running']} running, {peak['queued']} queued",
        )
        self.check(
            len(runs) == 2 and step.count("SUCCESS") == 2 and fences[0] < fences[-1]
            and runs[0].end <= runs[1].start,
            f"{name}: both ran, one after the other, fences rising",
            f"{len(runs)} runs, fences {fences}",
        )  # fmt: skip
        return step

    def scenarios(self, exports_queue: str, reminders_queue: str) -> list[Step]:
        """Play every scenario in order; return their steps for the summary."""
        tasks = self.tasks
        print("\n1. skip: 20 x sync_invoices(42), 19 of them sent while the first one runs")
        steps = [self.skip_storm(tasks.sync_invoices, 42, 20, "SingletonTask")]
        print("\n2. requeue: 5 x rebuild_report(7) sent at once")
        steps.append(self.requeue_storm(tasks.rebuild_report, 7, 5, "SingletonTask"))
        steps.append(self.fencing())
        print(f"\n4. per-queue, by configuration: 5 x export_statement(7) on {exports_queue}")
        print("   (a plain task; redlock_queues locks its queue with on_conflict=requeue)")
        self.queues_locked(exports_queue, reminders_queue)
        steps.append(self.requeue_storm(tasks.export_statement, 7, 5, "redlock_queues"))
        print(f"\n5. per-queue, by worker option: 10 x send_reminder(42) on {reminders_queue}")
        print("   (a plain task; the worker's --redlock-queues locks its queue, skip)")
        steps.append(self.skip_storm(tasks.send_reminder, 42, 10, "--redlock-queues"))
        print("\n6. until_executed: 20 clicks of 'generate' for nightly_report(2026-11-28)")
        steps.append(self.until_executed_clicks("2026-11-28", 20))
        print(
            f"\n7. until_executing, raise: 10 x refresh_rates(EUR) with a {RATES_COUNTDOWN:.0f} s"
            " countdown, then 1 more once it runs"
        )
        steps.append(self.until_executing_debounce("EUR", 10))
        print("\n8. until_and_while_executing: 20 x sync_catalog(5), 19 of them while one runs")
        steps.append(self.until_and_while_storm(5, 20))
        return steps

    # -- report ----------------------------------------------------------------------

    def report(self, steps: Sequence[Step]) -> None:
        print("\nSummary")
        rows: list[tuple[Any, ...]] = [
            (
                step.label,
                step.policy,
                step.sent,
                len(step.runs),
                step.count(SKIPPED),
                step.requeues,
                f"{step.seconds:.1f} s",
                step.locked_by,
            )
            for step in steps
        ]
        rows.append(
            (
                "all",
                "",
                sum(step.sent for step in steps),
                sum(len(step.runs) for step in steps),
                sum(step.count(SKIPPED) for step in steps),
                sum(step.requeues for step in steps),
                f"{sum(step.seconds for step in steps):.1f} s",
                "",
            )
        )
        header = ("task", "on conflict", "sent", "ran", "skipped", "requeues", "took", "locked by")
        for line in table(header, rows, "<<>>>>><"):
            print(f"  {line}")

        print("\nRuns (seconds from the step's first call, by the Redis clock)")
        rows = []
        for step in steps:
            for run in step.runs:
                args = ", ".join(str(arg) for arg in run.args)
                rows.append(
                    (
                        f"{run.task}({args})",
                        run.task_id[:8],
                        run.pid,
                        f"+{run.start - step.t0:.2f}",
                        f"+{run.end - step.t0:.2f}",
                        "-" if run.fence is None else run.fence,
                    )
                )
        header = ("run", "task id", "pid", "start", "end", "fence")
        for line in table(header, rows, "<<>>>>"):
            print(f"  {line}")

        windows = [step for step in steps if step.mode != "while_executing"]
        print("\nLock windows (what apply_async did with each call)")
        rows = [
            (
                step.label,
                step.mode,
                step.on_duplicate,
                step.sent,
                len(step.ids),
                step.same_id,
                step.raised,
                len(step.runs),
                step.count(SKIPPED),
                step.requeues,
                f"{step.seconds:.1f} s",
            )
            for step in [*steps[:1], *windows]
        ]
        windows_header = (
            "task", "lock_mode", "on duplicate", "sent", "published", "same id",
            "DuplicateTask", "ran", "skipped", "requeues", "took",
        )  # fmt: skip
        for line in table(windows_header, rows, "<<<>>>>>>>>"):
            print(f"  {line}")
        for line in self.window_lines:
            print(f"  {line}")

        print("\nFencing")
        for line in self.fencing_lines:
            print(f"  {line}")

        print("\nChecks")
        for check in self.checks:
            print(f"  {'ok  ' if check.ok else 'FAIL'}  {check.text}")


def run(server: LocalRedis, started: float) -> str | None:
    """Play the demo on ``server``; return what failed, or ``None`` if all went as expected."""
    url = with_db(server.url, DB)
    prefix = f"invoice-demo:{secrets.token_hex(3)}"
    # The app reads these when it is imported, in this process and in the worker.
    os.environ["DEMO_REDIS_URL"] = url
    os.environ["DEMO_KEY_PREFIX"] = prefix
    from . import tasks
    from .celery_app import EXPORTS_QUEUE, QUEUE, REMINDERS_QUEUE, WORKER_ARGS, ready_key

    print(f"Redis    {redacted(url)}")
    print(f"         {server.origin}; this run's keys: {prefix}:*")
    client = redis.Redis.from_url(url, decode_responses=True)
    log_dir = Path(tempfile.mkdtemp(prefix="invoice-demo-"))
    worker = Worker(
        {"DEMO_REDIS_URL": url, "DEMO_KEY_PREFIX": prefix},
        args=WORKER_ARGS,
        log_path=log_dir / "worker.log",
    )
    demo = Demo(client, prefix, tasks, worker, deadline=started + TIME_BUDGET)
    failure: str | None = None
    try:
        worker.start()
        demo.wait_for_key(
            f"Worker   prefork x{worker.concurrency}, pid {worker.pid} ...",
            ready_key(),
            ("starting", "ready"),
            timeout=30,
        )
        print(f"         queues {QUEUE}, {EXPORTS_QUEUE}, {REMINDERS_QUEUE}")
        print(f"         {' '.join(WORKER_ARGS[2:])}")
        steps = demo.scenarios(EXPORTS_QUEUE, REMINDERS_QUEUE)
        demo.report(steps)
    except DemoFailure as exc:
        failure = str(exc)
    except BaseException:  # Ctrl-C, SIGTERM or a bug: the traceback says more than the log
        shutil.rmtree(log_dir, ignore_errors=True)
        raise
    finally:
        with uninterruptible():
            worker.stop()
            deleted = delete_keys(client, prefix)
            client.close()
            print(f"\nCleanup  worker stopped; {deleted} keys under {prefix}:* deleted (db {DB})")

    failure = failure or "; ".join(check.text for check in demo.checks if not check.ok) or None
    if failure is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        print(f"\nThe worker's log is {worker.log_path}; its last lines:\n{worker.log_tail()}\n")
    return failure


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; see the module docstring for what it does and its exit codes."""
    parser = argparse.ArgumentParser(
        prog="scripts/demo",
        description="celery-redlock demo: an invoice-sync service on a real Celery worker. "
        "Set REDIS_URL to choose the Redis server; the demo uses its db 12.",
    )
    parser.parse_args(argv)
    started = time.monotonic()
    # SIGTERM unwinds like Ctrl-C does, so the worker and the keys are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("celery-redlock demo: an invoice-sync service on a real Celery worker\n")
    try:
        with LocalRedis() as server:
            failure = run(server, started)
        if server.pid is not None:
            print(f"Redis    stopped the private server (pid {server.pid})")
    except NoRedisError as exc:
        print(f"FAIL     no Redis: {exc}")
        return 2
    except KeyboardInterrupt:
        print("interrupted")
        return 130
    if failure is not None:
        print(f"FAIL     {failure}")
        return 1
    print(f"PASS     in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
