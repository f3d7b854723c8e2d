"""The 150 s fair-requeue soak: requeue with a line (new) beside plain backoff (old), one run.

Run from the repository root (Redis on 127.0.0.1:6379 for results; it starts
its own lock store and broker on free loopback ports and stops them by pid)::

    python bench/fairness_soak.py [--spread 150] [--calls 650] [--keys 5]

Three prefork workers of the chaos suite's app (tests/celery_apps/chaos.py,
two pool processes each, lock TTL 1 s, requeue delay 0.2 s doubling to 5 s).
For ``lock_limit`` 1 (``--keys`` keys), then 3 (``--keys3`` keys): a soak of
tasks with ``lock_fair=True``, then the same soak (same calls, same seed) with
``lock_fair=False``, on the same workers. Each sends ``--calls`` calls over
``--spread`` seconds with random durations (0.3 to 1.3 s: each key busy most
of the time), while random pool processes running them are SIGKILLed or
SIGSTOPped past their TTL (see tests/chaos/fairness.py). Printed per soak:
the longest wait, the 99th percentile, the mean, calls over the bound of
docs/conflicts.md, calls overtaken by one sent a second or more later, most
holders at once, lost calls.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.chaos.conftest import chaos_workers
from tests.chaos.fairness import Soak, most_believing, run_soak
from tests.redis_servers import RedisServer


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def _describe(name: str, soak: Soak) -> str:
    verdict = soak.verdict
    lost = len(verdict.lost) if verdict is not None else -1
    waits = list(soak.waits.values())
    return (
        f"| {name} | {len(soak.sent)} | {len(soak.faults)} | {soak.longest:.1f} | "
        f"{_percentile(waits, 0.99):.1f} | {sum(waits) / max(1, len(waits)):.1f} | "
        f"{len(soak.over_bound())} | {soak.overtaken()} | "
        f"{max(most_believing(soak.executions).values())} | {lost} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spread", type=float, default=150.0)
    parser.add_argument("--calls", type=int, default=650)
    parser.add_argument("--keys", type=int, default=5, help="keys of the lock_limit=1 soaks")
    parser.add_argument("--keys3", type=int, default=2, help="keys of the lock_limit=3 soaks")
    args = parser.parse_args()
    binary = os.environ.get("REDLOCK_TEST_REDIS_SERVER") or shutil.which("redis-server")
    assert binary, "redis-server not found"
    base = Path(tempfile.mkdtemp(prefix="fair-soak-"))
    print(
        "| soak | calls | faults | longest wait s | p99 s | mean s | over bound"
        " | overtaken | most at once | lost |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with chaos_workers(binary, base, [RedisServer(binary, workdir=base / "lock")]) as c:
        for limit, keys in ((1, args.keys), (3, args.keys3)):
            for label, task, seed in (
                ("fair (new)", f"chaos.fair{limit}", 1),
                ("backoff only (old)", f"chaos.unfair{limit}", 1),
            ):
                soak = run_soak(
                    c,
                    task,
                    limit,
                    calls=args.calls,
                    keys=keys,
                    spread=args.spread,
                    durations=(0.3, 1.3),
                    fault_every=3.0,
                    timeout=args.spread * 4,
                    seed=seed,
                )
                print(_describe(f"lock_limit={limit}, {keys} keys, {label}", soak), flush=True)


if __name__ == "__main__":
    main()
