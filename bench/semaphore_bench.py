"""Benchmark a semaphore permit cycle against the Lock cycle, in the same run.

Run from the repository root::

    python bench/semaphore_bench.py [--rounds N] [--cycles N] [--json out.json]

One process, one private ``redis-server`` on a free loopback port (started and
stopped by its pid, as in ``bench/lock_bench.py``, whose helpers this reuses).
Three contenders, each on its own key, 10 s TTL, no renewal:

- ``celery_redlock.Lock``: acquire + release;
- ``celery_redlock.Semaphore`` with ``limit=5``, uncontended (no other permit
  held): acquire + release of one permit;
- the same semaphore with 4 of its 5 permits held by others, to show what the
  permits already held cost an acquire (the script reads them).

Measurements:

1. paired rounds: every round runs each contender for ``--cycles`` cycles, in
   an order rotated per round (reversed on odd rounds); the ratio of a
   contender to the lock is taken per round (time per cycle / the lock's time
   per cycle in the same round) and the median over rounds is reported, so
   machine noise that hits a whole round cancels out;
2. round trips: a counting run under ``MONITOR`` of ``--count-cycles`` cycles,
   split into commands the client sent (each is one round trip: nothing here is
   pipelined) and commands run inside Lua, cross-checked with
   ``INFO commandstats``.

Target (issue 19): the uncontended N=5 semaphore cycle costs at most 1.15x the
Lock cycle and 2 round trips.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from lock_bench import (
    Cycle,
    _checked_cycle,
    count_commands,
    machine_context,
    percentile_us,
    private_redis_server,
    round_order,
    settle,
    timed_block,
)
from results import write_section

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import celery_redlock  # noqa: E402

TTL_SECONDS = 10
LIMIT = 5
LOCK = "celery_redlock.Lock"
SEMAPHORE = "celery_redlock.Semaphore (N=5, uncontended)"
CROWDED = "celery_redlock.Semaphore (N=5, 4 held)"
HEADING = "## Semaphore: acquire + release"
TARGET_RATIO = 1.15
TARGET_ROUND_TRIPS = 2


def lock_cycle(client: redis.Redis) -> Cycle:
    lock = celery_redlock.Lock(client, "bench:lock", timeout=TTL_SECONDS)
    return _checked_cycle(lock.acquire, lock.release)


def semaphore_cycle(client: redis.Redis, name: str = "bench:sem", held: int = 0) -> Cycle:
    for _ in range(held):  # other holders, kept for the whole run
        other = celery_redlock.Semaphore(client, name, limit=LIMIT, timeout=3600, blocking=False)
        if not other.acquire():
            raise RuntimeError("could not take a permit for the crowded semaphore")
    semaphore = celery_redlock.Semaphore(
        client, name, limit=LIMIT, timeout=TTL_SECONDS, blocking=False
    )
    return _checked_cycle(semaphore.acquire, semaphore.release)


@dataclass
class Result:
    """One contender's rounds and what they sum up to."""

    name: str
    cycles_per_s_rounds: list[float] = field(default_factory=list)
    cpu_us_rounds: list[float] = field(default_factory=list)
    server_cpu_us_rounds: list[float] = field(default_factory=list)
    latencies_ns: list[int] = field(default_factory=list)
    median_cycles_per_s: float = 0.0
    paired_time_ratio: float = 0.0
    p50_rounds_us: list[float] = field(default_factory=list)
    paired_p50_ratio: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    cpu_us: float = 0.0
    server_cpu_us: float = 0.0
    round_trips: float = 0.0
    lua_per_cycle: float = 0.0
    client_mix: dict[str, int] = field(default_factory=dict)
    lua_mix: dict[str, int] = field(default_factory=dict)
    consistent: bool = False


def run_rounds(
    cycles: dict[str, Cycle], rounds: int, per_round: int, admin: redis.Redis
) -> dict[str, Result]:
    names = list(cycles)
    results = {name: Result(name) for name in names}
    threads = __import__("threading").active_count()
    for r in range(rounds):
        for name in round_order(names, r):
            settle(threads)
            block = timed_block(cycles[name], per_round, admin)
            res = results[name]
            res.cycles_per_s_rounds.append(block.cycles_per_s)
            res.cpu_us_rounds.append(block.cpu_us_per_cycle)
            res.server_cpu_us_rounds.append(block.server_cpu_us_per_cycle)
            res.latencies_ns.extend(block.latencies_ns)
            res.p50_rounds_us.append(percentile_us(sorted(block.latencies_ns), 0.50))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    lock_rates = results[LOCK].cycles_per_s_rounds
    for res in results.values():
        res.median_cycles_per_s = statistics.median(res.cycles_per_s_rounds)
        res.paired_time_ratio = statistics.median(
            lock / ours for ours, lock in zip(res.cycles_per_s_rounds, lock_rates)
        )
        lock_p50 = results[LOCK].p50_rounds_us
        res.paired_p50_ratio = statistics.median(
            ours / lock for ours, lock in zip(res.p50_rounds_us, lock_p50)
        )
        pooled = sorted(res.latencies_ns)
        res.p50_us = percentile_us(pooled, 0.50)
        res.p99_us = percentile_us(pooled, 0.99)
        res.cpu_us = statistics.median(res.cpu_us_rounds)
        res.server_cpu_us = statistics.median(res.server_cpu_us_rounds)
    return results


def _mix(mix: dict[str, int], cycles: int) -> str:
    return ", ".join(f"{verb} {n / cycles:g}" for verb, n in sorted(mix.items())) or "-"


def render(results: dict[str, Result], context: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        HEADING,
        "",
        "Generated by `python bench/semaphore_bench.py` (method: its docstring).",
        "",
        "### Machine",
        "",
        *(f"- {key.replace('_', ' ')}: {value}" for key, value in context.items()),
        "",
        "### Uncontended cycles",
        "",
        f"{len(results[LOCK].cycles_per_s_rounds)} paired rounds of {args.cycles} cycles per "
        "contender, order rotated per round. x Lock time: time per cycle (the whole block) / "
        "the Lock's in the same round, median over rounds: the target's measure. x Lock p50: "
        "the same with each round's median cycle, which leaves out the cycles another process "
        "on the shared CPUs stalled (the p99 column).",
        "",
        "| contender | cycles/s (median) | x Lock time (paired) | x Lock p50 (paired) | p50 µs "
        "| p99 µs | client CPU µs/cycle | server CPU µs/cycle | round trips/cycle | client-sent "
        "| inside Lua/cycle | inside Lua |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    counted = args.count_cycles
    for res in results.values():
        lines.append(
            f"| {res.name} | {res.median_cycles_per_s:,.0f} | {res.paired_time_ratio:.3f} | "
            f"{res.paired_p50_ratio:.3f} | {res.p50_us:.0f} | {res.p99_us:.0f} | "
            f"{res.cpu_us:.0f} | {res.server_cpu_us:.1f} | "
            f"{res.round_trips:g} | {_mix(res.client_mix, counted)} | {res.lua_per_cycle:g} | "
            f"{_mix(res.lua_mix, counted)} |"
        )
    sem = results[SEMAPHORE]
    ratio_ok = sem.paired_time_ratio <= TARGET_RATIO
    trips_ok = sem.round_trips == TARGET_ROUND_TRIPS and sem.consistent
    lines += [
        "",
        "Per-round cycles/s:",
        "",
        *(
            f"- {res.name}: {', '.join(f'{rate:,.0f}' for rate in res.cycles_per_s_rounds)}"
            for res in results.values()
        ),
        "",
        "### Targets",
        "",
        f"- semaphore (N=5, uncontended) acquire+release <= {TARGET_RATIO}x the Lock cycle: "
        f"**{'met' if ratio_ok else 'NOT met'}** ({sem.paired_time_ratio:.3f}x, paired median; "
        f"{sem.paired_p50_ratio:.3f}x by the rounds' median cycles)",
        f"- {TARGET_ROUND_TRIPS} round trips per cycle: **{'met' if trips_ok else 'NOT met'}** "
        f"({sem.round_trips:g} client-sent commands per cycle under MONITOR: "
        f"{_mix(sem.client_mix, counted)}; commandstats consistent: {sem.consistent})",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--count-cycles", type=int, default=500)
    parser.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with private_redis_server() as port:
        client = redis.Redis(host="127.0.0.1", port=port)
        admin = redis.Redis(host="127.0.0.1", port=port)
        cycles = {
            LOCK: lock_cycle(client),
            SEMAPHORE: semaphore_cycle(client),
            CROWDED: semaphore_cycle(client, "bench:crowded", held=LIMIT - 1),
        }
        for cycle in cycles.values():  # warm up: connections, script caches
            for _ in range(200):
                cycle()
        results = run_rounds(cycles, args.rounds, args.cycles, admin)
        for name, cycle in cycles.items():
            count = count_commands(port, admin, name, cycle, args.count_cycles)
            res = results[name]
            res.round_trips = count.client_per_cycle
            res.lua_per_cycle = count.lua_per_cycle
            res.client_mix, res.lua_mix = count.client_mix, count.lua_mix
            res.consistent = count.consistent
        context = machine_context(client)
        for name in ("python_redis_lock", "pottery"):
            context.pop(name, None)
    report = render(results, context, args)
    print(report)
    if args.results != "-":
        write_section(Path(args.results), HEADING, report)
    if args.json:
        raw = {name: asdict(res) | {"latencies_ns": None} for name, res in results.items()}
        Path(args.json).write_text(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
