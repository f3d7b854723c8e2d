"""What lock metadata and per-task counters cost a real worker's task throughput.

Run from the repository root::

    python bench/ops_bench.py [--tasks 2000] [--rounds 5]

Two private ``redis-server`` processes (broker + result backend, lock store)
and two real prefork workers (``-c 2``) of ``bench.ops_app`` run side by side
in one run: ``full`` (lock values with metadata, counters on: the default)
and ``bare`` (``v1`` values, ``redlock_stats = False``). Rounds alternate the
two arms (order flipped every round); each run publishes ``--tasks`` distinct
calls of the ``SingletonTask`` ``bench.redlock`` to a fresh queue and then
tells one worker to consume it, exactly as ``bench/task_bench.py`` does (its
helpers are reused). Medians of tasks/s, the paired ratio per round, and the
workers' CPU per task are reported; an in-process measurement of the two
additions alone (building the lock value, and the two counting signal sends
of a task) puts the difference in microseconds. Writes the
``## Operator tooling overhead`` section of ``bench/RESULTS.md``.
Every process started here is stopped by its pid (or its own process group).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
from results import write_section
from task_bench import Bench, BenchError, Run, _tail, _terminate, private_redis

ROOT = Path(__file__).resolve().parent.parent
RESULTS_HEADING = "## Operator tooling overhead"
ARMS = ("full", "bare")
IDLE_QUEUE = "ops_bench.idle"


@contextlib.contextmanager
def ops_worker(env: dict[str, str], mode: str, log_path: Path, node: str) -> Iterator[int]:
    """Run a prefork -c 2 worker of ``bench.ops_app`` in ``mode`` until the block ends."""
    argv = [sys.executable, "-m", "celery", "-A", "bench.ops_app", "worker", "-P", "prefork"]
    argv += ["-c", "2", "--without-mingle", "--without-gossip", "--without-heartbeat"]
    argv += ["-Q", IDLE_QUEUE, "-n", node, "-l", "WARNING"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**env, "BENCH_OPS_MODE": mode},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc.pid
    finally:
        _terminate(proc, group=True, grace=15)


def wait_ready(app: Any, nodes: Sequence[str], timeout: float = 60) -> None:
    """Wait until every node answers a ping."""
    deadline = time.monotonic() + timeout
    waiting = set(nodes)
    while waiting:
        for reply in app.control.ping(destination=sorted(waiting), timeout=0.5) or ():
            waiting -= set(reply)
        if waiting and time.monotonic() > deadline:
            raise BenchError(f"workers not ready within {timeout:.0f} s: {sorted(waiting)}")


def microbench(repeat: int = 7, number: int = 20000) -> dict[str, float]:
    """Microseconds per task of the two additions, measured in this process.

    The lock value (``Holder.new(...).encode()``, v2 against the v1 stand-in
    of ``bench.ops_app``) and the ``lock_acquired`` + ``lock_released``
    signal sends of one task, without receivers and with the counters on.
    """
    from celery import Celery

    from celery_redlock import signals, stats
    from celery_redlock.holder import Holder

    v1_new = getattr(sys.modules.get("bench.ops_app"), "_new_v1", None)
    v1_encode = getattr(sys.modules.get("bench.ops_app"), "_encode_v1", None)
    assert v1_new is not None and v1_encode is not None

    def best(statement: Any) -> float:
        return min(timeit.repeat(statement, repeat=repeat, number=number)) / number * 1e6

    app = Celery("ops_micro", set_as_current=False)
    app.conf.redlock_url = "redis://127.0.0.1:1/0"  # never contacted; tasks validate it

    @app.task(name="ops.micro")  # type: ignore[untyped-decorator]
    def micro() -> None:
        """A task to send signals for."""

    task = app.tasks["ops.micro"]

    def sends() -> None:
        signals.lock_acquired.send(sender=task, task_id="t", key="k", fence=1, ttl=10.0)
        signals.lock_released.send(sender=task, task_id="t", key="k", fence=1, owned=True)

    result = {
        "value v1 µs": best(lambda: v1_encode(v1_new(Holder, "task-id", "node@host", ttl=10.0))),
        "value v2 µs": best(lambda: Holder.new("task-id", "node@host", ttl=10.0).encode()),
        "signals without counters µs": best(sends),
    }
    stats.enable(app, 2)
    result["signals with counters µs"] = best(sends)
    result["added µs/task"] = (
        result["value v2 µs"]
        - result["value v1 µs"]
        + result["signals with counters µs"]
        - result["signals without counters µs"]
    )
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Start the servers and both workers, run the rounds, return the raw data."""
    with tempfile.TemporaryDirectory(prefix="ops-bench-") as tmp:
        workdir = Path(tmp)
        with (
            private_redis(workdir, "broker") as broker_url,
            private_redis(workdir, "lock") as lock_url,
        ):
            env = dict(os.environ)
            env.update(BENCH_OPS_BROKER=broker_url, BENCH_OPS_LOCK_URL=lock_url)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            os.environ.update(BENCH_OPS_BROKER=broker_url, BENCH_OPS_LOCK_URL=lock_url)
            os.environ["BENCH_OPS_MODE"] = "bare"  # this process's app is never a worker
            sys.path.insert(0, str(ROOT))
            from bench.ops_app import app

            app.backend.on_task_call = lambda *a, **kw: None  # no SUBSCRIBE per publish
            broker = redis.Redis.from_url(broker_url)
            lock = redis.Redis.from_url(lock_url)
            nodes = {arm: f"ops{arm}{os.getpid()}@localhost" for arm in ARMS}
            with contextlib.ExitStack() as stack:
                pids = {
                    arm: stack.enter_context(
                        ops_worker(env, arm, workdir / f"{arm}.log", nodes[arm])
                    )
                    for arm in ARMS
                }
                try:
                    wait_ready(app, list(nodes.values()))
                except BenchError as exc:
                    logs = "\n".join(_tail(workdir / f"{arm}.log") for arm in ARMS)
                    raise BenchError(f"{exc}\n{logs}") from None
                benches = {
                    arm: Bench(app, nodes[arm], broker, lock, lambda tag: tag, pids[arm])
                    for arm in ARMS
                }
                benches["bare"].first_arg = 10**9  # distinct calls across arms
                for arm in ARMS:  # warm-up: scripts cached, connections open
                    benches[arm].run(arm, "bench.redlock", args.warmup)
                runs: dict[str, list[Run]] = {arm: [] for arm in ARMS}
                for round_no in range(args.rounds):
                    order = ARMS if round_no % 2 == 0 else ARMS[::-1]
                    for arm in order:
                        run = benches[arm].run(arm, "bench.redlock", args.tasks)
                        runs[arm].append(run)
                        _log(f"round {round_no + 1} {arm}: {run.rate:,.0f} tasks/s")
                stats_reply = app.control.broadcast(
                    "redlock_stats", reply=True, timeout=3, destination=[nodes["full"]]
                )
    return {"runs": runs, "stats_reply": stats_reply, "micro": microbench(), "load": _load()}


def _load() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


def _log(message: str) -> None:
    print(f"ops_bench: {message}", file=sys.stderr, flush=True)


def summarize(data: dict[str, Any], args: argparse.Namespace) -> str:
    """Return the Markdown section."""
    runs: dict[str, list[Run]] = data["runs"]
    rates = {arm: [run.rate for run in runs[arm]] for arm in ARMS}
    cpu = {arm: [run.worker_cpu_seconds / run.tasks * 1e6 for run in runs[arm]] for arm in ARMS}
    paired = [f / b for f, b in zip(rates["full"], rates["bare"])]
    ratio = statistics.median(rates["full"]) / statistics.median(rates["bare"])
    cpu_ratio = statistics.median(cpu["full"]) / statistics.median(cpu["bare"])
    micro = data["micro"]
    counted = {}
    for reply in data["stats_reply"] or ():
        for report in reply.values():
            counted = report.get("tasks", {}).get("bench.redlock", {})
    expected = args.warmup + args.rounds * args.tasks
    lines = [
        RESULTS_HEADING,
        "",
        "Generated by `python bench/ops_bench.py` (method: its docstring and `bench/ops_app.py`).",
        "",
        f"- date utc: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- python {platform.python_version()}, {os.cpu_count()} CPUs shared with other jobs; "
        f"load average at the end {data['load']}",
        f"- {args.rounds} rounds x {args.tasks} trivial `SingletonTask` calls per arm "
        f"(after {args.warmup} warm-up calls each), two prefork -c 2 workers alive side by side, "
        "arms alternating, order flipped every round.",
        "- **full**: lock values with metadata (`v2`) and per-task counters (the default); "
        "**bare**: `v1` values and `redlock_stats = False`.",
        "",
        "| arm | tasks/s (median) | per round | worker CPU µs/task (median) |",
        "|---|---:|---|---:|",
    ]
    for arm in ARMS:
        per_round = ", ".join(f"{rate:,.0f}" for rate in rates[arm])
        lines.append(
            f"| {arm} | {statistics.median(rates[arm]):,.0f} | {per_round} | "
            f"{statistics.median(cpu[arm]):,.0f} |"
        )
    lines += [
        "",
        f"- full / bare, tasks/s of the medians: **{ratio:.3f}**; paired per round: "
        f"median {statistics.median(paired):.3f} ({', '.join(f'{p:.3f}' for p in paired)})",
        f"- full / bare, worker CPU per task: {cpu_ratio:.3f}",
        "- in-process, the additions alone (best of 7 x 20,000): lock value v1 "
        f"{micro['value v1 µs']:.2f} µs, v2 {micro['value v2 µs']:.2f} µs; the two signal sends "
        f"of a task {micro['signals without counters µs']:.2f} µs without receivers, "
        f"{micro['signals with counters µs']:.2f} µs counting: "
        f"**{micro['added µs/task']:.2f} µs added per task**, "
        f"{micro['added µs/task'] / statistics.median(cpu['bare']) * 100:.2f}% of the bare "
        "worker's CPU per task.",
        f"- the full worker's `redlock_stats` reply for `bench.redlock`: {json.dumps(counted)} "
        f"(expected {expected} acquired and released)",
        "- Rates on a shared 2-CPU machine move by several percent between rounds; the CPU per "
        "task and the in-process figure are the steadier measures of the 2% budget.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; write the section unless ``--results -``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    args = parser.parse_args(argv)
    data = measure(args)
    section = summarize(data, args)
    print(section)
    if args.results != "-":
        write_section(Path(args.results), RESULTS_HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
