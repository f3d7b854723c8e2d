"""Benchmark celery_redlock.Lock against a raw SET NX PX + EVALSHA floor and other Redis locks.

Run from the repository root::

    python bench/lock_bench.py [--rounds N] [--cycles N] [--json out.json]

Everything runs in one process against a private ``redis-server`` started on a
free loopback port (binary from ``$REDLOCK_TEST_REDIS_SERVER`` or ``PATH``) and
stopped by its pid at the end, so ``INFO commandstats`` and ``CONFIG RESETSTAT``
see nothing but this benchmark. Three measurements, described in
``bench/README.md``:

1. uncontended acquire+release cycles: interleaved rounds, order rotated per
   round; median cycles/s over rounds, pooled p50/p99 latency per cycle;
2. Redis commands per cycle: a counting run under ``MONITOR`` (client-sent vs.
   inside-Lua commands) cross-checked against ``INFO commandstats`` deltas;
3. contended: threads fighting over one key for a fixed time; acquisitions/s and
   the number of overlapping hold intervals (must be 0).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import json
import math
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import redis
import redis.utils
from results import as_section, write_section
from servers import free_port, redis_server_binary

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import celery_redlock  # noqa: E402

TTL_SECONDS = 10
TTL_MS = TTL_SECONDS * 1000
RAW_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
FLOOR = "raw floor"
OURS = "celery_redlock.Lock"

Cycle = Callable[[], None]
# A per-thread (acquire, release) pair for the contended run; acquire blocks up
# to the contended acquire timeout and returns whether it got the lock.
Holder = tuple[Callable[[], bool], Callable[[], None]]


class BenchError(RuntimeError):
    """A contender misbehaved (e.g. failed an uncontended acquire)."""


# -- private redis-server ---------------------------------------------------------


def _wait_for_ping(port: int, proc: subprocess.Popen[bytes], deadline: float) -> bool:
    probe = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(redis.ConnectionError):
                if probe.ping():
                    return True
            time.sleep(0.05)
        return False
    finally:
        probe.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, 15)  # SIGTERM to our own child only
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, 9)
            proc.wait(timeout=10)


@contextlib.contextmanager
def private_redis_server() -> Iterator[int]:
    """Start a throw-away redis-server on a free loopback port; yield the port."""
    binary = redis_server_binary()
    with tempfile.TemporaryDirectory(prefix="lock-bench-") as workdir:
        for _attempt in range(5):
            port = free_port()
            argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            argv += ["--appendonly", "no", "--dir", workdir]
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                if _wait_for_ping(port, proc, time.monotonic() + 10):
                    yield port
                    return
            finally:
                _stop(proc)
        raise BenchError("could not start a private redis-server")


# -- contenders ---------------------------------------------------------------------


def _checked_cycle(acquire: Callable[[], object], release: Callable[[], object]) -> Cycle:
    def cycle() -> None:
        if not acquire():
            raise BenchError("uncontended acquire failed")
        release()

    return cycle


def raw_floor_cycle(client: redis.Redis, key: str) -> Cycle:
    """SET NX PX, then one EVALSHA of a compare-and-delete script loaded once."""
    sha = client.script_load(RAW_RELEASE_LUA)

    def cycle() -> None:
        token = secrets.token_hex(16)
        if not client.set(key, token, nx=True, px=TTL_MS):
            raise BenchError("uncontended acquire failed")
        client.evalsha(sha, 1, key, token)

    return cycle


def celery_redlock_cycle(client: redis.Redis, key: str) -> Cycle:
    lock = celery_redlock.Lock(client, key, timeout=TTL_SECONDS)
    return _checked_cycle(lock.acquire, lock.release)


def celery_redlock_nofence_cycle(client: redis.Redis, key: str) -> Cycle:
    lock = celery_redlock.Lock(client, key, timeout=TTL_SECONDS, fencing=False)
    return _checked_cycle(lock.acquire, lock.release)


def redis_py_cycle(client: redis.Redis, key: str) -> Cycle:
    lock = client.lock(key, timeout=TTL_SECONDS)
    return _checked_cycle(lock.acquire, lock.release)


def python_redis_lock_cycle(client: redis.Redis, key: str) -> Cycle:
    import redis_lock

    lock = redis_lock.Lock(client, key, expire=TTL_SECONDS, auto_renewal=False)
    return _checked_cycle(lock.acquire, lock.release)


def pottery_cycle(client: redis.Redis, key: str) -> Cycle:
    from pottery import Redlock

    lock = Redlock(key=key, masters={client}, auto_release_time=TTL_SECONDS)
    return _checked_cycle(lock.acquire, lock.release)


def celery_redlock_holder(client: redis.Redis, key: str, wait: float) -> Holder:
    lock = celery_redlock.Lock(client, key, timeout=TTL_SECONDS, sleep=0.001, blocking_timeout=wait)
    return lock.acquire, lock.release


def celery_redlock_nofence_holder(client: redis.Redis, key: str, wait: float) -> Holder:
    lock = celery_redlock.Lock(
        client, key, timeout=TTL_SECONDS, sleep=0.001, blocking_timeout=wait, fencing=False
    )
    return lock.acquire, lock.release


def redis_py_holder(client: redis.Redis, key: str, wait: float) -> Holder:
    lock = client.lock(key, timeout=TTL_SECONDS, sleep=0.001, blocking_timeout=wait)
    return lock.acquire, lock.release


def python_redis_lock_holder(client: redis.Redis, key: str, wait: float) -> Holder:
    import redis_lock

    lock = redis_lock.Lock(client, key, expire=TTL_SECONDS, auto_renewal=False)
    seconds = max(1, int(wait))  # it truncates its timeout to whole seconds (BLPOP)
    return (lambda: bool(lock.acquire(blocking=True, timeout=seconds))), lock.release


def pottery_holder(client: redis.Redis, key: str, wait: float) -> Holder:
    from pottery import Redlock

    lock = Redlock(key=key, masters={client}, auto_release_time=TTL_SECONDS)
    return (lambda: lock.acquire(blocking=True, timeout=wait)), lock.release


@dataclass(frozen=True)
class Contender:
    """A lock implementation under test, with its own Redis key."""

    name: str
    key: str
    make_cycle: Callable[[redis.Redis, str], Cycle]
    make_holder: Callable[[redis.Redis, str, float], Holder] | None


CONTENDERS: tuple[Contender, ...] = (
    Contender(FLOOR, "bench:raw", raw_floor_cycle, None),
    Contender(OURS, "bench:crl", celery_redlock_cycle, celery_redlock_holder),
    Contender(
        "celery_redlock.Lock(fencing=False)",
        "bench:crl-nofence",
        celery_redlock_nofence_cycle,
        celery_redlock_nofence_holder,
    ),
    Contender("redis-py redis.lock.Lock", "bench:redis-py", redis_py_cycle, redis_py_holder),
    Contender("python-redis-lock", "bench:prl", python_redis_lock_cycle, python_redis_lock_holder),
    Contender("pottery Redlock (1 master)", "bench:pottery", pottery_cycle, pottery_holder),
)


# -- uncontended throughput ---------------------------------------------------------


@dataclass
class Uncontended:
    """Per-contender results of the interleaved uncontended rounds."""

    name: str
    cycles_per_s_rounds: list[float] = field(default_factory=list)
    cpu_us_rounds: list[float] = field(default_factory=list)
    server_cpu_us_rounds: list[float] = field(default_factory=list)
    latencies_ns: list[int] = field(default_factory=list, repr=False)
    median_cycles_per_s: float = 0.0
    cpu_us_per_cycle: float = 0.0
    server_cpu_us_per_cycle: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    ratio_to_floor: float = 0.0
    paired_ratio_to_floor: float = 0.0


@dataclass
class Block:
    """One timed block of cycles."""

    cycles_per_s: float
    cpu_us_per_cycle: float
    server_cpu_us_per_cycle: float
    latencies_ns: list[int]


def server_cpu_seconds(admin: redis.Redis) -> float:
    """CPU time (user + sys) the private redis-server has used so far, from ``INFO cpu``."""
    cpu = admin.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def timed_block(cycle: Cycle, cycles: int, admin: redis.Redis) -> Block:
    """Run ``cycles`` cycles, timing each one and the block (wall, client and server CPU).

    The two ``INFO cpu`` reads sit outside the timed region; the server CPU they
    themselves cost (tens of µs per block) is below the reporting precision.
    """
    latencies = [0] * cycles
    clock = time.perf_counter_ns
    server_started = server_cpu_seconds(admin)
    cpu_started = time.process_time_ns()
    started = clock()
    for i in range(cycles):
        t0 = clock()
        cycle()
        latencies[i] = clock() - t0
    elapsed = clock() - started
    cpu = time.process_time_ns() - cpu_started
    server = server_cpu_seconds(admin) - server_started
    return Block(cycles * 1e9 / elapsed, cpu / cycles / 1000, server / cycles * 1e6, latencies)


def settle(baseline_threads: int, timeout: float = 2.0) -> None:
    """Let helper threads of the previous block (pottery's executors) exit, then collect."""
    give_up_at = time.monotonic() + timeout
    while threading.active_count() > baseline_threads and time.monotonic() < give_up_at:
        time.sleep(0.001)
    gc.collect()


def round_order(names: list[str], r: int) -> list[str]:
    """Rotate by ``r``; reverse odd rounds, so no contender always follows the same one."""
    shift = r % len(names)
    order = names[shift:] + names[:shift]
    return order[::-1] if r % 2 else order


def percentile_us(sorted_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of sorted nanoseconds, in microseconds."""
    rank = max(1, math.ceil(q * len(sorted_ns)))
    return sorted_ns[rank - 1] / 1000


def run_uncontended(
    cycles_by_name: dict[str, Cycle],
    rounds: int,
    cycles: int,
    admin: redis.Redis,
    budget_s: float,
) -> dict[str, Uncontended]:
    """Interleaved rounds; after 3 rounds, stop early if the next would exceed ``budget_s``."""
    names = list(cycles_by_name)
    results = {name: Uncontended(name) for name in names}
    baseline_threads = threading.active_count()
    started = time.monotonic()
    for r in range(rounds):
        elapsed = time.monotonic() - started
        if r >= 3 and elapsed + elapsed / r > budget_s:
            log(f"uncontended: time budget reached, stopping after {r} rounds")
            break
        for name in round_order(names, r):
            settle(baseline_threads)
            block = timed_block(cycles_by_name[name], cycles, admin)
            results[name].cycles_per_s_rounds.append(block.cycles_per_s)
            results[name].cpu_us_rounds.append(block.cpu_us_per_cycle)
            results[name].server_cpu_us_rounds.append(block.server_cpu_us_per_cycle)
            results[name].latencies_ns.extend(block.latencies_ns)
    floor = results[FLOOR].cycles_per_s_rounds
    for res in results.values():
        summarize(res, floor)
    return results


def summarize(res: Uncontended, floor: list[float]) -> None:
    """Fill in the medians, percentiles and ratios of ``res`` from its raw rounds."""
    res.median_cycles_per_s = statistics.median(res.cycles_per_s_rounds)
    res.cpu_us_per_cycle = statistics.median(res.cpu_us_rounds)
    res.server_cpu_us_per_cycle = statistics.median(res.server_cpu_us_rounds)
    pooled = sorted(res.latencies_ns)
    res.p50_us = percentile_us(pooled, 0.50)
    res.p99_us = percentile_us(pooled, 0.99)
    res.ratio_to_floor = res.median_cycles_per_s / statistics.median(floor)
    pairs = zip(res.cycles_per_s_rounds, floor)
    res.paired_ratio_to_floor = statistics.median(a / b for a, b in pairs)


# -- command counting -------------------------------------------------------------


@dataclass
class CommandCount:
    """Commands one contender's counting run caused on the server, per cycle."""

    name: str
    cycles: int
    client_per_cycle: float = 0.0
    lua_per_cycle: float = 0.0
    server_per_cycle: float = 0.0
    client_mix: dict[str, int] = field(default_factory=dict)
    lua_mix: dict[str, int] = field(default_factory=dict)
    commandstats_delta: dict[str, int] = field(default_factory=dict)
    consistent: bool = False


def _commandstats_calls(admin: redis.Redis) -> Counter[str]:
    stats = admin.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()})


def _monitored_run(
    port: int, admin: redis.Redis, cycle: Cycle | None, cycles: int
) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """One counting pass: RESETSTAT, MONITOR, cycles, sentinel, INFO commandstats.

    Returns (client-sent commands, inside-Lua commands, commandstats calls). The
    MONITOR lines stop at a sentinel ECHO sent by ``admin`` after the cycles.
    """
    sentinel = f"lock-bench-sentinel-{secrets.token_hex(8)}"
    client_cmds: Counter[str] = Counter()
    lua_cmds: Counter[str] = Counter()
    watcher = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
    admin.config_resetstat()
    with watcher.monitor() as monitor:  # type: ignore[no-untyped-call]
        if cycle is not None:
            for _ in range(cycles):
                cycle()
        admin.echo(sentinel)
        while True:
            line = monitor.next_command()
            command = line["command"]
            if command.endswith(sentinel):
                break
            verb = command.split(" ", 1)[0].lower()
            (lua_cmds if line["client_type"] == "lua" else client_cmds)[verb] += 1
        calls = _commandstats_calls(admin)
    watcher.close()
    return client_cmds, lua_cmds, calls


def count_commands(
    port: int, admin: redis.Redis, name: str, cycle: Cycle, cycles: int
) -> CommandCount:
    """Count one contender's commands per cycle, exactly; see bench/README.md."""
    _, _, baseline = _monitored_run(port, admin, None, 0)
    client_cmds, lua_cmds, calls = _monitored_run(port, admin, cycle, cycles)
    delta = Counter(calls)
    delta.subtract(baseline)
    delta = Counter({k: v for k, v in delta.items() if v})
    server_total = sum(delta.values())
    return CommandCount(
        name=name,
        cycles=cycles,
        client_per_cycle=sum(client_cmds.values()) / cycles,
        lua_per_cycle=sum(lua_cmds.values()) / cycles,
        server_per_cycle=server_total / cycles,
        client_mix=dict(client_cmds),
        lua_mix=dict(lua_cmds),
        commandstats_delta=dict(delta),
        consistent=server_total == sum(client_cmds.values()) + sum(lua_cmds.values()),
    )


# -- contended ------------------------------------------------------------------------


@dataclass
class Contended:
    """Results of threads fighting over one key for a fixed time."""

    name: str
    threads: int
    seconds: float
    acquisitions: int = 0
    acquisitions_per_s: float = 0.0
    busiest_share: float = 0.0
    overlaps: int = 0
    lost_updates: int = 0
    acquire_timeouts: int = 0
    errors: list[str] = field(default_factory=list)
    stuck_threads: int = 0


class _Shared:
    """State the contending threads share; ``counter`` detects lost updates."""

    def __init__(self) -> None:
        self.counter = 0
        self.timeouts = 0
        self.errors: list[str] = []
        self.deadline = 0.0
        self.guard = threading.Lock()  # only for timeouts/errors bookkeeping

    def start(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds


def _contend(
    holder: Holder,
    shared: _Shared,
    holds: list[tuple[float, float]],
    start_line: threading.Barrier,
) -> None:
    acquire, release = holder
    start_line.wait()
    while time.monotonic() < shared.deadline:
        try:
            if not acquire():
                with shared.guard:
                    shared.timeouts += 1
                continue
            start = time.monotonic()
            value = shared.counter  # unprotected read-modify-write: only the
            time.sleep(0)  # distributed lock keeps it exact
            shared.counter = value + 1
            end = time.monotonic()
            release()
            holds.append((start, end))
        except Exception as exc:
            with shared.guard:
                shared.errors.append(f"{type(exc).__name__}: {exc}")


def count_overlaps(holds: list[tuple[float, float]]) -> int:
    """Number of hold intervals that start before an earlier-starting one ended."""
    overlaps = 0
    latest_end = -math.inf
    for start, end in sorted(holds):
        if start < latest_end:
            overlaps += 1
        latest_end = max(latest_end, end)
    return overlaps


def run_contended(
    client: redis.Redis, contender: Contender, threads: int, seconds: float, wait: float
) -> Contended:
    assert contender.make_holder is not None
    shared = _Shared()
    per_thread: list[list[tuple[float, float]]] = [[] for _ in range(threads)]
    holders = [contender.make_holder(client, contender.key, wait) for _ in range(threads)]
    start_line = threading.Barrier(threads, action=lambda: shared.start(seconds))
    workers = [
        threading.Thread(target=_contend, args=(h, shared, hs, start_line), daemon=True)
        for h, hs in zip(holders, per_thread)
    ]
    for worker in workers:
        worker.start()
    join_by = shared.deadline + wait + 15
    for worker in workers:
        worker.join(max(0.0, join_by - time.monotonic()))
    holds = [hold for hs in per_thread for hold in hs]
    in_window = sum(1 for start, _ in holds if start < shared.deadline)
    busiest = max(sum(1 for start, _ in hs if start < shared.deadline) for hs in per_thread)
    return Contended(
        name=contender.name,
        threads=threads,
        seconds=seconds,
        acquisitions=in_window,
        acquisitions_per_s=in_window / seconds,
        busiest_share=busiest / in_window if in_window else 0.0,
        overlaps=count_overlaps(holds),
        lost_updates=len(holds) - shared.counter,
        acquire_timeouts=shared.timeouts,
        errors=shared.errors[:5],
        stuck_threads=sum(1 for w in workers if w.is_alive()),
    )


# -- machine context and report ----------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_context(client: redis.Redis) -> dict[str, Any]:
    server = client.info("server")
    conn_kwargs = client.connection_pool.connection_kwargs
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "redis_py": redis.__version__,
        "hiredis": _version("hiredis"),
        "hiredis_in_use": bool(redis.utils.HIREDIS_AVAILABLE),
        "resp_protocol": conn_kwargs.get("protocol") or 2,
        "redis_server": server["redis_version"],
        "python_redis_lock": _version("python-redis-lock"),
        "pottery": _version("pottery"),
        "connection": "TCP 127.0.0.1 (private server, same host)",
    }


def _mix(mix: dict[str, int], cycles: int) -> str:
    parts = [f"{verb} {n / cycles:g}" for verb, n in sorted(mix.items())]
    return ", ".join(parts) or "-"


def uncontended_table(unc: dict[str, Uncontended], counts: dict[str, CommandCount]) -> list[str]:
    lines = [
        "| contender | cycles/s (median) | x floor | x floor (paired) | p50 µs | p99 µs "
        "| client CPU µs/cycle | server CPU µs/cycle | client cmds/cycle "
        "| server cmds/cycle incl. Lua | client-sent | inside Lua |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, res in unc.items():
        cnt = counts[name]
        mismatch = "" if cnt.consistent else " (!)"
        lines.append(
            f"| {name} | {res.median_cycles_per_s:,.0f} | {res.ratio_to_floor:.3f} "
            f"| {res.paired_ratio_to_floor:.3f} | {res.p50_us:.1f} | {res.p99_us:.1f} "
            f"| {res.cpu_us_per_cycle:.1f} | {res.server_cpu_us_per_cycle:.1f} "
            f"| {cnt.client_per_cycle:g} | {cnt.server_per_cycle:g}{mismatch} "
            f"| {_mix(cnt.client_mix, cnt.cycles)} | {_mix(cnt.lua_mix, cnt.cycles)} |"
        )
    return lines


def contended_table(results: list[Contended]) -> list[str]:
    lines = [
        "| contender | threads | acquisitions/s | busiest thread's share | overlapping holds "
        "| lost updates | acquire timeouts | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        errors = len(res.errors) + res.stuck_threads
        lines.append(
            f"| {res.name} | {res.threads} | {res.acquisitions_per_s:,.0f} "
            f"| {res.busiest_share:.0%} | {res.overlaps} "
            f"| {res.lost_updates} | {res.acquire_timeouts} | {errors} |"
        )
    return lines


def target_lines(unc: dict[str, Uncontended], counts: dict[str, CommandCount]) -> list[str]:
    ours = unc[OURS]
    others = [r for n, r in unc.items() if n not in (FLOOR, OURS) and not n.startswith(OURS)]
    best_other = max(others, key=lambda r: r.median_cycles_per_s)

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**NOT met**"

    client_cmds = counts[OURS].client_per_cycle
    ahead = ours.median_cycles_per_s > best_other.median_cycles_per_s
    return [
        f"- >= 0.95x raw floor cycles/s: {verdict(ours.ratio_to_floor >= 0.95)} "
        f"({ours.ratio_to_floor:.3f}x by medians, {ours.paired_ratio_to_floor:.3f}x paired "
        "per round)",
        f"- ahead of every other library: {verdict(ahead)}"
        f" ({ours.median_cycles_per_s:,.0f}/s vs best other, {best_other.name}, "
        f"{best_other.median_cycles_per_s:,.0f}/s)",
        f"- 2 client commands per cycle: {verdict(client_cmds == 2)} ({client_cmds:g})",
    ]


def render_markdown(
    report: dict[str, Any], unc_lines: list[str], con_lines: list[str], targets: list[str]
) -> str:
    ctx = report["machine"]
    params = report["parameters"]
    context = [f"- {key.replace('_', ' ')}: {value}" for key, value in ctx.items()]
    return "\n".join(
        [
            "# Lock benchmark results",
            "",
            "Generated by `python bench/lock_bench.py` (see `bench/README.md` for the method).",
            "",
            "## Machine",
            "",
            *context,
            "",
            "## Parameters",
            "",
            f"- uncontended: {params['rounds']} interleaved rounds x {params['cycles']} cycles "
            f"per contender, TTL {TTL_SECONDS} s; commands counted over "
            f"{params['count_cycles']} cycles",
            f"- contended: {params['threads']} threads, {params['contended_seconds']} s per "
            f"contender, acquire wait up to {params['acquire_wait']} s",
            "",
            "## Uncontended acquire+release",
            "",
            *unc_lines,
            "",
            "## Contended (one key)",
            "",
            *con_lines,
            "",
            "## Targets",
            "",
            *targets,
            "",
        ]
    )


# -- main -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds (default 25)")
    parser.add_argument(
        "--cycles", type=int, default=800, help="cycles per contender per round (default 800)"
    )
    parser.add_argument(
        "--count-cycles", type=int, default=1000, help="cycles of the command-counting run"
    )
    parser.add_argument("--threads", type=int, default=8, help="contending threads (default 8)")
    parser.add_argument(
        "--contended-seconds", type=float, default=3.0, help="duration per contender (default 3)"
    )
    parser.add_argument(
        "--acquire-wait", type=float, default=2.0, help="contended acquire timeout in seconds"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=110.0,
        help="seconds the uncontended rounds may take before stopping early (default 110)",
    )
    parser.add_argument("--json", type=Path, help="also write the raw results as JSON here")
    parser.add_argument(
        "--results",
        type=Path,
        default=ROOT / "bench" / "RESULTS.md",
        help="Markdown report path (default bench/RESULTS.md); '-' to skip",
    )
    args = parser.parse_args(argv)
    if min(args.rounds, args.cycles, args.count_cycles, args.threads) < 1:
        parser.error("--rounds, --cycles, --count-cycles and --threads must be >= 1")
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def benchmark(port: int, args: argparse.Namespace) -> dict[str, Any]:
    client = redis.Redis(host="127.0.0.1", port=port)
    admin = redis.Redis(host="127.0.0.1", port=port)
    cycles_by_name = {c.name: c.make_cycle(client, c.key) for c in CONTENDERS}
    for name, cycle in cycles_by_name.items():  # warm-up: scripts cached, pool filled
        log(f"warm-up: {name}")
        timed_block(cycle, 300, admin)
    log(f"uncontended: {args.rounds} rounds x {args.cycles} cycles")
    unc = run_uncontended(cycles_by_name, args.rounds, args.cycles, admin, args.budget)
    log("counting commands")
    counts = {
        name: count_commands(port, admin, name, cycle, args.count_cycles)
        for name, cycle in cycles_by_name.items()
    }
    contended = []
    for contender in CONTENDERS:
        if contender.make_holder is not None:
            log(f"contended: {contender.name}")
            contended.append(
                run_contended(
                    client, contender, args.threads, args.contended_seconds, args.acquire_wait
                )
            )
    report: dict[str, Any] = {
        "machine": machine_context(client),
        "parameters": {
            "rounds": len(unc[FLOOR].cycles_per_s_rounds),
            "cycles": args.cycles,
            "count_cycles": args.count_cycles,
            "threads": args.threads,
            "contended_seconds": args.contended_seconds,
            "acquire_wait": args.acquire_wait,
        },
        "uncontended": {
            n: {k: v for k, v in asdict(r).items() if k != "latencies_ns"} for n, r in unc.items()
        },
        "commands": {n: asdict(c) for n, c in counts.items()},
        "contended": [asdict(c) for c in contended],
    }
    report["markdown"] = render_markdown(
        report,
        uncontended_table(unc, counts),
        contended_table(contended),
        target_lines(unc, counts),
    )
    client.close()
    admin.close()
    return report


RESULTS_HEADING = "## Lock: acquire + release"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with private_redis_server() as port:
        log(f"private redis-server on 127.0.0.1:{port}")
        report = benchmark(port, args)
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    print(report["markdown"])
    if str(args.results) != "-":
        write_section(
            args.results, RESULTS_HEADING, as_section(report["markdown"], RESULTS_HEADING)
        )
        log(f"wrote {args.results}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        log(f"wrote {args.json}")
    log(f"done in {report['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
