"""The skip path of two revisions side by side: duplicate storms on two prefork workers, paired.

Run from the repository root, with the project's virtualenv::

    python bench/skip_storm.py --old PATH [--rounds 5] [--storm 500]

``PATH`` is a checkout of another revision. The benchmark starts a private
broker Redis and a private lock-store Redis, and two real prefork workers
(``-c 2``) of ``bench.task_app``: one runs the package of ``PATH`` (started
from that checkout), the other this tree's. Each round runs
``bench/task_bench.py``'s duplicate storm on both, in alternating order:
``--storm`` copies of one ``bench.hold`` call, one of which holds the lock
while the other pool process skips the rest, each skip recording ``SKIPPED``.
It reports per round and as medians the duplicates skipped per second and the
worker's CPU (main process and pool processes, from ``/proc``) per duplicate,
and the new/old ratio of each round (paired: both ran under the same load).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import redis
from task_bench import ROOT, Bench, BenchError, Storm, _tail, _terminate, private_redis


@contextmanager
def worker(app: object, tree: Path, env: dict[str, str], log: Path, node: str) -> Iterator[int]:
    """A prefork worker whose ``celery_redlock`` and ``bench`` come from ``tree``.

    Started from ``tree``: ``python -m`` puts the working directory first on
    the path, ahead of ``PYTHONPATH``.
    """
    argv = [sys.executable, "-m", "celery", "-A", "bench.task_app", "worker", "-P", "prefork"]
    argv += ["-c", "2", "--without-mingle", "--without-gossip", "--without-heartbeat"]
    argv += ["-Q", f"skip_storm.idle.{node}", "-n", node, "-l", "WARNING"]
    env = dict(env, PYTHONPATH=str(tree))
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(destination=[node], timeout=0.5):  # type: ignore[attr-defined]
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"worker {node} did not start:\n{_tail(log)}")
        yield proc.pid
    finally:
        _terminate(proc, group=True, grace=15)


def _row(label: str, storms: list[Storm]) -> str:
    rates = [s.rate for s in storms]
    cpu = [s.worker_cpu_seconds / s.duplicates * 1e6 for s in storms]
    return (
        f"| {label} | {statistics.median(rates):,.0f} | {statistics.median(cpu):,.0f} "
        f"| {', '.join(f'{r:,.0f}' for r in rates)} |"
    )


def main(argv: list[str] | None = None) -> int:
    """Run paired storms on the old and the new tree and print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="checkout of the revision to compare")
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds")
    parser.add_argument("--storm", type=int, default=500, help="duplicates per storm")
    args = parser.parse_args(argv)
    trees = {"old": Path(args.old).resolve(), "new": ROOT}
    storms: dict[str, list[Storm]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="skip-storm-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        broker_url = stack.enter_context(private_redis(workdir, "broker"))
        lock_url = stack.enter_context(private_redis(workdir, "lock"))
        os.environ.update(BENCH_TASK_BROKER=broker_url, BENCH_TASK_LOCK_URL=lock_url)
        sys.path.insert(0, str(ROOT))
        from bench.task_app import app, stop_key

        app.backend.on_task_call = lambda producer, task_id: None
        broker, lock = redis.Redis.from_url(broker_url), redis.Redis.from_url(lock_url)
        benches = {}
        for side, tree in trees.items():
            node = f"skipstorm-{side}-{os.getpid()}@localhost"
            log = workdir / f"{side}.log"
            pid = stack.enter_context(worker(app, tree, dict(os.environ), log, node))
            benches[side] = Bench(app, node, broker, lock, stop_key, pid)
            benches[side].storm(50)  # warm-up: imports, connections, scripts loaded
        for round_no in range(args.rounds):
            for side in ("old", "new") if round_no % 2 == 0 else ("new", "old"):
                storm = benches[side].storm(args.storm)
                storms[side].append(storm)
                print(
                    f"[skip_storm] round {round_no + 1} {side}: {storm.rate:,.0f} dup/s, "
                    f"{storm.worker_cpu_seconds / storm.duplicates * 1e6:,.0f} µs CPU/dup "
                    f"{storm.states}",
                    file=sys.stderr,
                )
    ratios = [n.rate / o.rate for o, n in zip(storms["old"], storms["new"], strict=True)]
    cpu_ratios = [
        n.worker_cpu_seconds / o.worker_cpu_seconds
        for o, n in zip(storms["old"], storms["new"], strict=True)
    ]
    print("| tree | dup/s (median) | worker CPU µs/dup (median) | dup/s per round |")
    print("|---|---:|---:|---|")
    print(_row(f"old ({trees['old'].name})", storms["old"]))
    print(_row("new", storms["new"]))
    print(
        f"\nnew/old dup/s, paired per round: median {statistics.median(ratios):.2f}x "
        f"({', '.join(f'{r:.2f}' for r in ratios)}); worker CPU new/old: "
        f"median {statistics.median(cpu_ratios):.2f}x; "
        f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
