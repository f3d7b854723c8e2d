"""Benchmark celery_redlock.asyncio.Lock against redis-py's asyncio Lock, in one run.

Run from the repository root::

    python bench/async_bench.py [--rounds N] [--cycles N] [--results PATH|-]

Both locks run on one event loop against a private ``redis-server`` started on
a free loopback port (binary from ``$REDLOCK_TEST_REDIS_SERVER`` or ``PATH``) and
stopped by its pid at the end. A cycle is one uncontended ``await acquire()``
plus ``await release()``, TTL 10 s. Rounds interleave the contenders and rotate
their order, so drift in machine load falls on all of them alike; reported are
the median cycles/s over rounds, the median of the per-round ratios (the figure
the target is judged on: both sides of a pair share their round's load) and the
client CPU time per cycle. The report replaces its own section of
``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, Callable

import redis.asyncio
import redis.asyncio.lock
from lock_bench import private_redis_server
from results import write_section

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import celery_redlock.asyncio  # noqa: E402

TTL_SECONDS = 10
REFERENCE = "redis-py redis.asyncio.lock.Lock"
OURS = "celery_redlock.asyncio.Lock"
RESULTS_HEADING = "## asyncio Lock: acquire + release"

Cycle = Callable[[], Awaitable[None]]


class BenchError(RuntimeError):
    """A contender misbehaved (e.g. failed an uncontended acquire)."""


def make_cycle(lock: Any) -> Cycle:
    async def cycle() -> None:
        if not await lock.acquire(blocking=False):
            raise BenchError(f"uncontended acquire of {lock!r} failed")
        await lock.release()

    return cycle


def contenders(client: Any) -> dict[str, Cycle]:
    return {
        REFERENCE: make_cycle(redis.asyncio.lock.Lock(client, "bench:redis-py", TTL_SECONDS)),
        OURS: make_cycle(celery_redlock.asyncio.Lock(client, "bench:ours", TTL_SECONDS)),
        f"{OURS}(fencing=False)": make_cycle(
            celery_redlock.asyncio.Lock(client, "bench:nofence", TTL_SECONDS, fencing=False)
        ),
        f"{OURS}(auto_renew=True)": make_cycle(
            celery_redlock.asyncio.Lock(client, "bench:renew", TTL_SECONDS, auto_renew=True)
        ),
    }


async def timed(cycle: Cycle, n: int) -> tuple[float, float]:
    """Run ``n`` cycles; return cycles per second and client CPU microseconds per cycle.

    CPU time is the steadier figure on a shared machine: it leaves out the time
    the process waited for a core.
    """
    cpu_started = time.process_time()
    started = time.perf_counter()
    for _ in range(n):
        await cycle()
    elapsed = time.perf_counter() - started
    return n / elapsed, (time.process_time() - cpu_started) / n * 1e6


async def benchmark(port: int, rounds: int, cycles: int) -> dict[str, Any]:
    client = redis.asyncio.Redis(host="127.0.0.1", port=port)
    try:
        by_name = contenders(client)
        for cycle in by_name.values():  # warm-up: scripts cached, connection open
            await timed(cycle, 300)
        names = list(by_name)
        per_round: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        for i in range(rounds):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                rate, cpu_us = await timed(by_name[name], cycles)
                per_round[name].append(rate)
                cpu[name].append(cpu_us)
        server = (await client.info("server"))["redis_version"]
    finally:
        await client.aclose()
    return {"per_round": per_round, "cpu": cpu, "server": server}


def render(result: dict[str, Any], rounds: int, cycles: int) -> str:
    per_round = result["per_round"]
    reference = per_round[REFERENCE]
    rows = []
    for name, values in per_round.items():
        median = statistics.median(values)
        paired = statistics.median(v / r for v, r in zip(values, reference))
        cpu_us = statistics.median(result["cpu"][name])
        rows.append(
            f"| {name} | {median:,.0f} | {median / statistics.median(reference):.3f} "
            f"| {paired:.3f} | {min(values):,.0f} | {max(values):,.0f} | {cpu_us:.1f} |"
        )
    ours = per_round[OURS]
    ratio = statistics.median(ours) / statistics.median(reference)
    # Judged on the per-round pairs: on a shared machine the load drifts between
    # rounds far more than within one, and a pair shares its round's load.
    paired = statistics.median(v / r for v, r in zip(ours, reference))
    cpu_ratio = statistics.median(result["cpu"][REFERENCE]) / statistics.median(result["cpu"][OURS])
    met = "met" if paired >= 0.95 else "NOT met"
    try:
        hiredis = importlib.metadata.version("hiredis")
    except importlib.metadata.PackageNotFoundError:
        hiredis = "not installed"
    lines = [
        RESULTS_HEADING,
        "",
        "Generated by `python bench/async_bench.py`: uncontended `await acquire()` + "
        "`await release()` on one event loop, both locks in one run.",
        "",
        "### Machine",
        "",
        f"- date utc: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- cpus usable: {len(os.sched_getaffinity(0))}",
        f"- python: {platform.python_implementation()} {platform.python_version()}",
        f"- redis py: {importlib.metadata.version('redis')}",
        f"- hiredis: {hiredis}",
        f"- redis server: {result['server']}",
        "- connection: TCP 127.0.0.1 (private server, same host), one `redis.asyncio.Redis`",
        "",
        "### Parameters",
        "",
        f"- {rounds} interleaved rounds x {cycles} cycles per contender, order rotated "
        f"each round, TTL {TTL_SECONDS} s",
        "",
        "### Uncontended acquire+release",
        "",
        "| contender | cycles/s (median) | x redis-py | x redis-py (paired) | min | max "
        "| client CPU µs/cycle |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "### Targets",
        "",
        f"- >= 0.95x redis-py's asyncio Lock: **{met}** ({paired:.3f}x paired per round; "
        f"{ratio:.3f}x by medians over rounds; {cpu_ratio:.3f}x by client CPU per cycle)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--cycles", type=int, default=1000, help="cycles per round (default 1000)")
    parser.add_argument(
        "--results",
        default=str(ROOT / "bench" / "RESULTS.md"),
        help="Markdown report path (default bench/RESULTS.md); '-' to skip",
    )
    args = parser.parse_args(argv)
    if min(args.rounds, args.cycles) < 1:
        parser.error("--rounds and --cycles must be >= 1")
    with private_redis_server() as port:
        result = asyncio.run(benchmark(port, args.rounds, args.cycles))
    markdown = render(result, args.rounds, args.cycles)
    print(markdown)
    if args.results != "-":
        write_section(Path(args.results), RESULTS_HEADING, markdown)
        print(f"wrote {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
