"""Instructions per task in one pool process: SingletonTask against plain and the incumbents.

Run from the repository root, with the project's virtualenv::

    python bench/task_instructions.py [--old PATH] [--calls 300] [--skip-calls 100]

The wall-clock benchmark (``bench/task_bench.py``) needs a quiet machine; on
two cores shared with other test runs its rates swing by several times from
round to round. This counts instead what a pool process executes per task,
which load does not change: each variant runs ``--calls`` tasks through
Celery's own tracer (``build_tracer`` after ``setup_worker_optimizations``,
results stored in a private redis-server that is also the lock store), with
the worker's counters on as a worker turns them on (``stats.enable`` and
``metrics.enable``, whose receivers every task's signals reach), under
``valgrind --tool=callgrind``. Counters are zeroed and dumped on entry to
``time.process_time``, which the probe calls right before and after the
counted calls, so the dump holds exactly those (after 100 warm-up calls and
``gc.freeze()``).

Variants: ``plain`` (``bench.plain``), ``task`` (``bench.redlock``, uncontended,
distinct arguments), ``once`` and ``singleton`` (the incumbents' worker side),
``skip`` (``bench.hold`` whose lock another holder has: acquire refused,
``SKIPPED`` recorded, the run ended as ``celery_redlock.celery.skipping``
says), and ``floor`` (``bench.floor``: a plain task with two library-free
round trips to the lock store around its body, the least two commands cost)
and ``floor_scripts`` (the same with celery-redlock's own two scripts);
``bare_lock`` and ``redispy_lock`` (a plain task taking celery-redlock's bare
``Lock`` or redis-py's ``Lock`` in its body: a lock client alone).
``--old PATH`` also counts ``task`` and ``skip`` for the package at PATH (a
checkout of another revision), in the same run. ``--ablate`` also counts
``task`` with one of its parts made a no-op at a time (see ``ABLATIONS``),
then with all of them: what each part of the task path costs, and what is left
to the lock and the guard once they are gone. Instructions are
user-space only: the system calls of the round trips are not in them, which
is why the wall-clock benchmark still decides the throughput targets.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "plain": "bench.plain",
    "task": "bench.redlock",
    "once": "bench.once",
    "singleton": "bench.singleton",
    "skip": "bench.hold",
    "floor": "bench.floor",
    "floor_scripts": "bench.floor_scripts",
    "bare_lock": "bench.bare_lock",
    "redispy_lock": "bench.redispy_lock",
}
PROCESS_TIME_SYMBOL = "time_process_time"


def _ablate_events() -> None:
    from celery_redlock.celery import events

    events.send_acquired = lambda *args, **kwargs: None  # type: ignore[assignment]
    events.send_released = lambda *args, **kwargs: None  # type: ignore[assignment]


def _ablate_watch() -> None:
    from celery_redlock.core.renewal import Watchdog

    Watchdog.watch = lambda self, lease: None  # type: ignore[method-assign]


def _ablate_holder() -> None:
    from celery_redlock.core.holder import Holder

    Holder.new_value = staticmethod(lambda task_id, *args, **kwargs: task_id)  # type: ignore[method-assign]


def _ablate_key() -> None:
    from celery_redlock.core.keys import KeyBuilder

    KeyBuilder.key_for = lambda self, args, kwargs: f"{self.prefix}:{args[0]}"  # type: ignore[method-assign]


def _ablate_queue() -> None:
    from celery_redlock.celery import task

    task.locked_queue = lambda task: None  # type: ignore[assignment]


#: The parts of the task path ``--ablate`` takes out one at a time, each made a
#: no-op (the task still takes and releases its lock): what each one costs.
ABLATIONS = {
    "events": ("the lock counters and signals (stats, metrics)", _ablate_events),
    "watch": ("registering the lease with the renewal watchdog", _ablate_watch),
    "holder": ("the holder value (task id, host, pid, TTL, queue, time)", _ablate_holder),
    "key": ("the key from the call's signature (canonical JSON, SHA-256)", _ablate_key),
    "queue": ("looking up the locked queue the task came from", _ablate_queue),
}


def probe(variant: str, url: str, calls: int) -> None:
    """Run ``calls`` traced tasks of ``variant`` between two ``time.process_time`` calls."""
    os.environ.update(BENCH_TASK_BROKER=url, BENCH_TASK_LOCK_URL=url)
    import celery.app.trace as trace
    import redis

    from bench.task_app import app
    from celery_redlock.celery import metrics, stats

    trace.setup_worker_optimizations(app, hostname="probe")
    stats.enable(app, 2)
    metrics.enable(app, 2)
    if variant.startswith("task-without-"):
        parts = variant.removeprefix("task-without-")
        for part in ABLATIONS if parts == "all" else [parts]:
            ABLATIONS[part][1]()
        variant = "task"
    name = VARIANTS[variant]
    tracer = trace.build_tracer(name, app.tasks[name], app=app, eager=False)
    if variant == "skip":
        held = app.tasks[name].lock_key_for("probe", 60.0)
        redis.Redis.from_url(url).set(held, "v1|token|holder|probe|1", px=600_000)
        arguments = iter(lambda: ("probe", 60.0), None)
    else:
        first = time.time_ns() // 1000  # distinct from any earlier run's keys
        arguments = ((first + i,) for i in range(10**9))
    delivery = {"exchange": "", "routing_key": "celery", "priority": 0, "redelivered": False}
    ids = [str(uuid.uuid4()) for _ in range(calls + 100)]

    def call(task_id: str) -> None:
        args = next(arguments)
        request = {"id": task_id, "hostname": "probe", "args": args, "kwargs": {}}
        tracer(task_id, args, {}, dict(request, delivery_info=delivery))

    for task_id in ids[:100]:
        call(task_id)
    gc.collect()
    gc.freeze()
    cpu = time.process_time()
    for task_id in ids[100:]:
        call(task_id)
    cpu = time.process_time() - cpu
    print(json.dumps({"calls": calls, "cpu_us": cpu / calls * 1e6}))


def count(tree: Path, variant: str, url: str, calls: int, workdir: Path) -> float:
    """Instructions per call of ``variant`` with the package of ``tree``, from callgrind."""
    out = workdir / f"{variant}.{abs(hash(str(tree)))}.callgrind"
    argv = ["valgrind", "--tool=callgrind", "--quiet", f"--callgrind-out-file={out}"]
    argv += [f"--zero-before={PROCESS_TIME_SYMBOL}", f"--dump-before={PROCESS_TIME_SYMBOL}"]
    argv += [sys.executable, __file__, "--probe", variant, "--url", url, "--calls", str(calls)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]))
    env["PYTHONHASHSEED"] = "0"
    subprocess.run(argv, env=env, cwd=ROOT, check=True, timeout=3600, capture_output=True)
    for line in out.with_name(out.name + ".2").read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1]) / calls
    raise RuntimeError(f"no totals in {out}.2")


def main(argv: list[str] | None = None) -> int:
    """Count every variant (and ``task``/``skip`` of ``--old``) and print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="counted tasks per variant")
    parser.add_argument("--skip-calls", type=int, default=100, help="counted skips")
    parser.add_argument("--old", default=None, help="checkout of another revision to compare")
    parser.add_argument("--ablate", action="store_true", help="count each part of the task path")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        probe(args.probe, args.url, args.calls)
        return 0
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not on PATH")
    sys.path.insert(0, str(ROOT))
    from bench.task_bench import private_redis

    trees = [("new", ROOT)] + ([("old", Path(args.old).resolve())] if args.old else [])
    rows: dict[tuple[str, str], float] = {}
    with (
        tempfile.TemporaryDirectory(prefix="task-instr-") as tmp,
        private_redis(Path(tmp), "redis") as url,
    ):
        for side, tree in trees:
            for variant in VARIANTS if side == "new" else ("task", "skip"):
                calls = args.skip_calls if variant == "skip" else args.calls
                rows[(side, variant)] = count(tree, variant, url, calls, Path(tmp))
                print(f"{side} {variant}: {rows[(side, variant)]:,.0f}", file=sys.stderr)
        for part in [*ABLATIONS, "all"] if args.ablate else []:
            variant = f"task-without-{part}"
            rows[("new", variant)] = count(ROOT, variant, url, args.calls, Path(tmp))
            print(f"new {variant}: {rows[('new', variant)]:,.0f}", file=sys.stderr)
    plain = rows[("new", "plain")]
    print("| variant | instructions/task | over plain |")
    print("|---|---:|---:|")
    for (side, variant), value in rows.items():
        label = f"{variant} ({side})" if args.old else variant
        over = "-" if variant in ("plain", "skip") else f"{value - plain:+,.0f}"
        print(f"| {label} | {value:,.0f} | {over} |")
    if args.ablate:
        print_ablation(rows)
    return 0


def print_ablation(rows: dict[tuple[str, str], float]) -> None:
    """What each part of the task path costs, and what the lock and guard cost without them."""
    task = rows[("new", "task")]
    print("\n| part made a no-op | instructions/task saved |")
    print("|---|---:|")
    for part, (what, _) in ABLATIONS.items():
        print(f"| {part}: {what} | {task - rows[('new', f'task-without-{part}')]:,.0f} |")
    bare = rows[("new", "task-without-all")]
    print(f"| all of them | {task - bare:,.0f} |")
    floor = rows[("new", "floor_scripts")]
    print(
        f"\nWithout them a task costs {bare - rows[('new', 'plain')]:+,.0f} over plain, "
        f"{bare - floor:+,.0f} over the script floor: the lock and the guard themselves "
        "(the lock object, the scripts' call path, the lease, the guarded routine)."
    )


if __name__ == "__main__":
    sys.exit(main())
