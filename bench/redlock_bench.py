"""Benchmark celery_redlock.Redlock against Lock on one master and pottery's Redlock.

Run from the repository root::

    python bench/redlock_bench.py [--rounds N] [--cycles N] [--json out.json]

Five private ``redis-server`` processes are started on free loopback ports
(``lock_bench.private_redis_server``: binary from ``$REDLOCK_TEST_REDIS_SERVER``
or ``PATH``) and stopped by their pids at the end, also on errors. Every
contender runs uncontended acquire+release cycles on its own key with a 10 s
TTL, in interleaved rounds whose order rotates, so machine noise hits all of
them alike. Reported per contender: the median over rounds of cycles/s, p50 and
p99 of the pooled per-cycle latencies, the latency ratio to ``Lock`` on one
master (pooled p50s, and the median of per-round ratios), and client and server
CPU per cycle (server CPU summed over the masters).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import redis

BENCH = Path(__file__).resolve().parent
for path in (BENCH, BENCH.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from fanout_floor import FanoutFloor  # noqa: E402
from lock_bench import (  # noqa: E402
    BenchError,
    machine_context,
    percentile_us,
    private_redis_server,
    round_order,
    settle,
    timed_block,
)
from results import as_section, write_section  # noqa: E402

import celery_redlock  # noqa: E402

TTL_SECONDS = 10
SINGLE = "Lock, 1 master"
FIVE = "Redlock, 5 masters"
POTTERY = "pottery Redlock, 5 masters"
FLOOR_ONE = "raw floor, 1 master"
FLOOR_FIVE = "raw fan-out floor, 5 masters"
SCRIPT_FLOOR_FIVE = "script fan-out floor, 5 masters"
#: Cores the masters and the client share; the CPU bound divides by this.
CORES = len(os.sched_getaffinity(0))
LATENCY_TARGET = 1.5
THROUGHPUT_TARGET = 2.0

Cycle = Callable[[], None]


def cycle_of(lock: Any, acquire: Callable[[], bool]) -> Cycle:
    def cycle() -> None:
        if not acquire():
            raise BenchError(f"{lock!r}: an uncontended acquire failed")
        lock.release()

    return cycle


def contenders(clients: list[redis.Redis], ports: list[int]) -> dict[str, Cycle]:
    from pottery import Redlock as PotteryRedlock

    def ours(lock: Any) -> Cycle:
        return cycle_of(lock, functools.partial(lock.acquire, blocking=False))

    pottery = PotteryRedlock(key="bench:pottery", masters=set(clients),
                             auto_release_time=TTL_SECONDS)  # fmt: skip
    return {
        SINGLE: ours(celery_redlock.Lock(clients[0], "bench:lock", timeout=TTL_SECONDS)),
        "Redlock, 3 masters": ours(
            celery_redlock.Redlock(clients[:3], "bench:redlock3", timeout=TTL_SECONDS)
        ),
        FIVE: ours(celery_redlock.Redlock(clients, "bench:redlock5", timeout=TTL_SECONDS)),
        "Redlock, 5 masters, fencing=False": ours(
            celery_redlock.Redlock(clients, "bench:nofence5", timeout=TTL_SECONDS, fencing=False)
        ),
        POTTERY: cycle_of(pottery, functools.partial(pottery.acquire, blocking=False)),
        # What the transport, the servers and the machine cost without any library.
        FLOOR_ONE: FanoutFloor(ports[:1], "bench:floor1").cycle,
        FLOOR_FIVE: FanoutFloor(ports, "bench:floor5").cycle,
        # The same with the library's two scripts: the masters' work of a fenced round.
        SCRIPT_FLOOR_FIVE: FanoutFloor(ports, "bench:scriptfloor5", scripts=True).cycle,
    }


class AllServers:
    """Looks like one admin client to ``timed_block``; its ``INFO cpu`` sums every master."""

    def __init__(self, clients: Sequence[redis.Redis]) -> None:
        self.clients = clients

    def info(self, section: str) -> dict[str, float]:
        infos = [client.info(section) for client in self.clients]
        return {
            key: sum(float(info[key]) for info in infos)
            for key in ("used_cpu_user", "used_cpu_sys")
        }


def run(clients: list[redis.Redis], ports: list[int], args: argparse.Namespace) -> dict[str, Any]:
    cycles = contenders(clients, ports)
    names = list(cycles)
    admin = AllServers(clients)
    for name in names:
        for _ in range(args.warmup):
            cycles[name]()
    settle(0)
    baseline_threads = threading.active_count()
    blocks: dict[str, list[Any]] = {name: [] for name in names}
    splits: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    started = time.monotonic()
    for r in range(args.rounds):
        for name in round_order(names, r):
            before = resource.getrusage(resource.RUSAGE_SELF)
            blocks[name].append(timed_block(cycles[name], args.cycles, admin))
            after = resource.getrusage(resource.RUSAGE_SELF)
            # The kernel's share of the client's CPU: loopback TCP is most of it.
            splits[name].append(
                (
                    (after.ru_utime - before.ru_utime) / args.cycles * 1e6,
                    (after.ru_stime - before.ru_stime) / args.cycles * 1e6,
                )
            )
            settle(baseline_threads)
        log(f"round {r + 1}/{args.rounds} done at {time.monotonic() - started:.0f} s")
        if r >= 2 and time.monotonic() - started > args.budget:
            log(f"stopping after {r + 1} rounds: over the {args.budget} s budget")
            break
    rows = summarize(blocks)
    for name, row in rows.items():
        # The kernel splits a process's CPU into user and system time by sampling
        # at each timer tick, a few dozen per block: the mean over rounds, unlike
        # the median of so coarse a reading, converges on the true split.
        row["client_user_us"] = statistics.fmean(user for user, _ in splits[name])
        row["client_sys_us"] = statistics.fmean(system for _, system in splits[name])
    return rows


def summarize(blocks: dict[str, list[Any]]) -> dict[str, Any]:
    rows: dict[str, dict[str, float]] = {}
    single_means = [statistics.fmean(b.latencies_ns) for b in blocks[SINGLE]]
    floor_p50s = [statistics.median(b.latencies_ns) for b in blocks[FLOOR_FIVE]]
    script_p50s = [statistics.median(b.latencies_ns) for b in blocks[SCRIPT_FLOOR_FIVE]]
    for name, runs in blocks.items():
        pooled = sorted(ns for block in runs for ns in block.latencies_ns)
        means = [statistics.fmean(b.latencies_ns) for b in runs]
        rows[name] = {
            "rounds": len(runs),
            "cycles_per_s": statistics.median(b.cycles_per_s for b in runs),
            "p50_us": percentile_us(pooled, 0.50),
            "p99_us": percentile_us(pooled, 0.99),
            # Same round, same machine state: the ratio that noise disturbs least.
            "paired_latency_ratio": statistics.median(m / s for m, s in zip(means, single_means)),
            # This round's p50 over the 5-master floor's in the same round.
            "floor_p50_ratio": statistics.median(
                statistics.median(b.latencies_ns) / f for b, f in zip(runs, floor_p50s)
            ),
            # The same over the script floor's: what is left to the client.
            "script_floor_p50_ratio": statistics.median(
                statistics.median(b.latencies_ns) / f for b, f in zip(runs, script_p50s)
            ),
            "client_cpu_us": statistics.median(b.cpu_us_per_cycle for b in runs),
            "server_cpu_us": statistics.median(b.server_cpu_us_per_cycle for b in runs),
        }
    for row in rows.values():
        row["p50_ratio"] = row["p50_us"] / rows[SINGLE]["p50_us"]
    return rows


def section(title: str, body: list[str]) -> list[str]:
    """A Markdown section: heading, body, blank line."""
    return [f"## {title}\n", *body, ""]


def render(
    rows: dict[str, dict[str, float]], context: dict[str, Any], args: argparse.Namespace
) -> str:
    five, single, pottery = rows[FIVE], rows[SINGLE], rows[POTTERY]
    latency_ok = five["p50_ratio"] <= LATENCY_TARGET
    throughput = five["cycles_per_s"] / pottery["cycles_per_s"]
    table = [
        "| contender | cycles/s | p50 µs | p99 µs | x Lock p50 | x Lock (paired) "
        "| x 5-master floor p50 (paired) "
        "| client CPU µs/cycle (user + sys) | server CPU µs/cycle (all masters) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    parameters = [
        f"- {single['rounds']:.0f} rounds x {args.cycles} cycles per contender "
        f"(after {args.warmup} warm-up cycles)",
        "- cycles/s: median over rounds; p50/p99: pooled per-cycle latencies",
        "- x Lock (paired): median over rounds of mean latency / Lock's in the same round",
        "- x 5-master floor p50 (paired): median over rounds of the round's p50 / the "
        "raw fan-out floor's p50 in the same round",
    ]
    lines = [
        "# Redlock benchmark results\n",
        "Generated by `python bench/redlock_bench.py`: uncontended acquire+release on",
        "private redis-servers (one process each, same host), TTL 10 s, each contender",
        "on its own key, interleaved rounds with rotating order.\n",
        *section("Machine", [f"- {key.replace('_', ' ')}: {v}" for key, v in context.items()]),
        *section("Parameters", parameters),
        *section("Acquire + release", table),
    ]
    lines.pop()  # the table goes on below
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['cycles_per_s']:,.0f} | {row['p50_us']:.1f} | {row['p99_us']:.1f} "
            f"| {row['p50_ratio']:.2f} | {row['paired_latency_ratio']:.2f} "
            f"| {row['floor_p50_ratio']:.2f} "
            f"| {row['client_cpu_us']:.1f} ({row['client_user_us']:.0f} + "
            f"{row['client_sys_us']:.0f}) | {row['server_cpu_us']:.1f} |"
        )
    targets = [
        f"- 5-master Redlock p50 within {LATENCY_TARGET}x of Lock on one master: "
        f"**{'met' if latency_ok else 'not met'}** ({five['p50_ratio']:.2f}x by pooled p50, "
        f"{five['paired_latency_ratio']:.2f}x paired)",
        f"- 5-master Redlock >= {THROUGHPUT_TARGET}x pottery's cycles/s: "
        f"**{'met' if throughput >= THROUGHPUT_TARGET else 'not met'}** ({throughput:.1f}x)",
    ]
    lines += ["", *section("Targets", targets), *section("Where the time goes", analysis(rows))]
    return "\n".join(lines)


def cpu_bound_us(row: dict[str, float]) -> float:
    """Least wall time a cycle can take given its CPU: the client's part runs on one
    thread, and client plus servers share the machine's cores."""
    return max(row["client_cpu_us"], (row["client_cpu_us"] + row["server_cpu_us"]) / CORES)


def analysis(rows: dict[str, dict[str, float]]) -> list[str]:
    """Explain the 5-master latency from the floors and the CPU columns, in numbers."""
    single, five = rows[SINGLE], rows[FIVE]
    floor1, floor5 = rows[FLOOR_ONE], rows[FLOOR_FIVE]
    budget = LATENCY_TARGET * single["p50_us"]
    left = budget - floor5["p50_us"]
    room = (
        f"which leaves a Redlock client {left:.0f} µs for its own work"
        if left > 0
        else f"already {-left:.0f} µs over the target before any library work"
    )
    if cpu_bound_us(floor5) > budget or floor5["p50_us"] > budget:
        verdict = (
            "On this machine the 5-master latency is CPU-bound, and the "
            f"{LATENCY_TARGET}x target is out of reach of any client, this one included."
        )
    else:
        verdict = "The floor would allow the target here; the rest is this client's own work."
    return [
        f"- The raw floors (no library: pre-packed commands, one `write()` per master, "
        f"`poll()`, hiredis; see `bench/fanout_floor.py`) put a 5-master cycle at "
        f"{floor5['p50_us'] / floor1['p50_us']:.1f}x a 1-master cycle on this "
        f"{CORES}-core machine: {floor5['p50_us']:.0f} µs against {floor1['p50_us']:.0f} µs "
        "(p50). Five server processes and the client share the cores, and each master "
        "costs a socket write, a wake-up and a read on both sides.",
        f"- The target, {LATENCY_TARGET}x Lock's p50, is {budget:.0f} µs. The 5-master floor "
        f"alone takes {floor5['p50_us']:.0f} µs, {room} (timeouts, votes, fences, validity, "
        f"connection bookkeeping). celery_redlock's Redlock takes "
        f"{five['p50_us'] - floor5['p50_us']:.0f} µs above the 5-master floor; Lock takes "
        f"{single['p50_us'] - floor1['p50_us']:.0f} µs above the 1-master floor.",
        f"- CPU per cycle: Lock {single['client_cpu_us']:.0f} µs client + "
        f"{single['server_cpu_us']:.0f} µs server; 5-master Redlock "
        f"{five['client_cpu_us']:.0f} µs client + {five['server_cpu_us']:.0f} µs over the "
        f"masters; the 5-master floor {floor5['client_cpu_us']:.0f} + "
        f"{floor5['server_cpu_us']:.0f} µs. Spread perfectly over {CORES} cores, a cycle "
        f"cannot take less than that CPU allows: {cpu_bound_us(floor5):.0f} µs for the floor "
        f"({cpu_bound_us(floor5) / single['p50_us']:.2f}x Lock's p50), "
        f"{cpu_bound_us(five):.0f} µs for Redlock "
        f"({cpu_bound_us(five) / single['p50_us']:.2f}x). {verdict}",
        f"- Of the Redlock client's CPU, {five['client_sys_us']:.0f} µs is the kernel's "
        f"(loopback TCP: each write also runs the receiving side and wakes a server), "
        f"against {floor5['client_sys_us']:.0f} µs for the floor; its user-space Python is "
        f"{five['client_user_us']:.0f} µs against the floor's {floor5['client_user_us']:.0f}: "
        "per master and operation, the checks the floor leaves out (node timeouts, "
        "late replies, reconnects, script caches, the vote, fences and validity). "
        "`bench/redlock_profile.py --callgrind` counts it in instructions, which a "
        "loaded machine does not blur (see `bench/README.md`).",
        f"- The masters spend {five['server_cpu_us'] - floor5['server_cpu_us']:.0f} µs more "
        "per cycle on Redlock than on the floor's `SET NX PX` + `EVALSHA`: the acquire is "
        "a Lua script that also draws the fence, and the release goes as `EVAL` with its "
        "source, so that a `NOSCRIPT` reply nobody reads can never drop it. On two cores "
        "that CPU queues behind the client's, which is why Redlock's p50 stays further "
        "above the floor's than its own CPU alone explains.",
        *script_floor(rows),
        "- On separate hosts (what Redlock is for) each master has its own CPU, the "
        "servers' work overlaps instead of queueing, and the cost that remains is the "
        "client's: one write and one read per master.",
        "",
    ]


def script_floor(rows: dict[str, dict[str, float]]) -> list[str]:
    """What the fenced scripts cost the masters, from the script floor, in numbers."""
    five, floor5, scripts = rows[FIVE], rows[FLOOR_FIVE], rows[SCRIPT_FLOOR_FIVE]
    over_p50 = five["script_floor_p50_ratio"]
    over_user = five["client_user_us"] / max(scripts["client_user_us"], 1e-9)
    return [
        f"- The script floor (the raw floor's client sending celery-redlock's own acquire, "
        f"which draws a fence, and release scripts) takes {scripts['p50_us']:.0f} µs: "
        f"{scripts['floor_p50_ratio']:.2f}x the raw floor's p50 (paired), with "
        f"{scripts['server_cpu_us']:.0f} µs of server CPU against the raw floor's "
        f"{floor5['server_cpu_us']:.0f}. Fenced Redlock is {over_p50:.2f}x the script "
        f"floor's p50 (paired) and its client user CPU {over_user:.1f}x the script floor's: "
        "what is above the script floor is the client's; what is between the two floors "
        "is the masters' work for fences.",
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--cycles", type=int, default=300, help="cycles per contender and round")
    parser.add_argument("--warmup", type=int, default=200, help="warm-up cycles per contender")
    parser.add_argument("--budget", type=float, default=90.0,
                        help="seconds the rounds may take; stops early after 3 rounds")  # fmt: skip
    parser.add_argument("--results", default=str(BENCH / "RESULTS.md"),
                        help="Markdown report ('-' to skip)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="raw results")
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


RESULTS_HEADING = "## Redlock: acquire + release over N masters"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with contextlib.ExitStack() as servers:
        ports = [servers.enter_context(private_redis_server()) for _ in range(5)]
        log(f"private redis-servers on 127.0.0.1:{', '.join(map(str, ports))}")
        clients = [redis.Redis(host="127.0.0.1", port=port) for port in ports]
        context = machine_context(clients[0])
        rows = run(clients, ports, args)
        for client in clients:
            client.close()
    markdown = render(rows, context, args)
    print(markdown)
    if args.results != "-":
        write_section(Path(args.results), RESULTS_HEADING, as_section(markdown, RESULTS_HEADING))
        log(f"wrote {args.results}")
    if args.json:
        args.json.write_text(json.dumps({"context": context, "rows": rows}, indent=2))
    log(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
