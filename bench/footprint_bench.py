"""Store footprint and renewal at scale: keys left by distinct calls, memory per held lock,
the watchdog's cost with 10,000 locks on one Redis and 100,000 on a 3-master Cluster.

Run from the repository root::

    python bench/footprint_bench.py [--distinct 20000] [--held 10000]
                                    [--cluster-held 100000] [--rounds 5]

Private ``redis-server`` processes on free loopback ports (binary from
``$REDLOCK_TEST_REDIS_SERVER`` or ``PATH``), stopped by pid at the end.

1. Footprint, side by side in one run: ``--distinct`` Lock acquire+release
   cycles of distinct names with the per-name fence key of earlier versions
   (``fence_key=<name>:fence``, the same script) and with the store's counter
   (the default); keys left and ``used_memory`` growth. Paired rounds of
   ``--rounds`` x 1,000 cycles per variant (order alternating) give the
   uncontended cycle cost of each, as client CPU per cycle and its ratio.
2. Memory per held lock: ``MEMORY USAGE`` of a held task lock (a v2 holder
   value) and of a per-name fence key, and ``used_memory`` growth per lock
   with ``--held`` locks held.
3. Renewal with ``--held`` locks on one Redis: the watchdog driven directly
   with a fake clock, 15 periods (5 TTLs). Per period: round trips (writes on
   a connection), EVALSHA calls, client CPU (``time.process_time``). Then the
   watchdog thread itself keeps them for 5 TTLs of 3 s: locks lost, renewals.
4. Renewal with ``--cluster-held`` locks on a 3-master Cluster (keys over all
   slots), 6 periods driven directly: round trips per master, EVALSHA calls,
   client CPU per period, locks renewed once per period.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
import redis.connection
from results import write_section
from servers import free_port, redis_server_binary

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from celery_redlock import Lock, Watchdog  # noqa: E402
from celery_redlock.core.fences import fence_key_for  # noqa: E402
from celery_redlock.core.holder import Holder  # noqa: E402
from celery_redlock.core.lease import Lease  # noqa: E402
from celery_redlock.core.lock_options import key_beside  # noqa: E402
from celery_redlock.core.scripts import ACQUIRE, RENEW  # noqa: E402

HEADING = "## Store footprint and renewal at scale"


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NeverStarted:
    """Stands in for the watchdog thread: passes are driven by hand."""

    def is_alive(self) -> bool:
        return True


@contextmanager
def redis_server(extra: tuple[str, ...] = ()) -> Iterator[redis.Redis]:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="fp-bench-")
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir, *extra],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


@contextmanager
def counted_writes() -> Iterator[Counter[int]]:
    """Count writes (pipelined or not: one per round trip) per server port."""
    writes: Counter[int] = Counter()
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        writes[self.port] += 1
        return original(self, *args, **kwargs)

    redis.connection.AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        yield writes
    finally:
        redis.connection.AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


def evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha")
    return int(stats["calls"]) if stats else 0


# -- 1 and 2: footprint and memory ----------------------------------------------------


def cycles(client: redis.Redis, names: list[str], old_layout: bool) -> list[int]:
    fences = []
    for name in names:
        fence_key = key_beside(name, "fence") if old_layout else None
        lock = Lock(client, name, timeout=10, fence_key=fence_key)
        lock.acquire(blocking=False)
        fences.append(lock.fence or 0)
        lock.release()
    return fences


def footprint(distinct: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with redis_server() as client:
        for label, old in (("per-name fence key (before)", True), ("store counter (after)", False)):
            client.flushall()
            base = int(client.info("memory")["used_memory"])
            names = [f"fp:v1:{{t.job:{secrets.token_hex(32)}}}" for _ in range(distinct)]
            cycles(client, names, old)
            out[label] = {
                "keys": client.dbsize(),
                "memory": int(client.info("memory")["used_memory"]) - base,
            }
        # Paired rounds: client CPU per uncontended acquire+release, each layout.
        per_round: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(rounds):
            order = [("before", True), ("after", False)]
            if r % 2:
                order.reverse()
            for label, old in order:
                names = [f"fp:v1:{{t.job:{secrets.token_hex(32)}}}" for _ in range(1000)]
                start = time.process_time()
                cycles(client, names, old)
                per_round[label].append((time.process_time() - start) / 1000 * 1e6)
        out["cycle_cpu"] = per_round
        out["ratios"] = [a / b for a, b in zip(per_round["after"], per_round["before"])]
    return out


def memory_per_lock(held: int) -> dict[str, Any]:
    with redis_server() as client:
        name = f"redlock:v1:{{app.tasks.report:{secrets.token_hex(32)}}}"
        holder = Holder.new("7f1c3a54-0d3e-4d55-9a8e-2b3f8d7c1e90", "celery@worker-1", ttl=60)
        lock = Lock(client, name, timeout=60)
        assert lock.acquire(blocking=False, token=holder.encode())
        old_fence = key_beside(name, "fence")
        client.set(old_fence, lock.fence or 0, px=3_600_000)
        usage = {
            "lock key": client.memory_usage(name, samples=0),
            "per-name fence key (before)": client.memory_usage(old_fence, samples=0),
            "store counter (after, shared)": client.memory_usage(fence_key_for(name), samples=0),
        }
        client.flushall()
        base = int(client.info("memory")["used_memory"])
        pipe = client.pipeline(transaction=False)
        client.script_load(ACQUIRE.source)
        for n in range(held):
            key = f"redlock:v1:{{app.tasks.report:{n:064x}}}"
            value = Holder.new(f"task-{n}", "celery@worker-1", ttl=60).encode()
            ACQUIRE.queue(pipe, (key, fence_key_for(key)), (value, 60_000, 3_600_000, "0"))
        pipe.execute()
        usage["used_memory per held lock (after)"] = (
            int(client.info("memory")["used_memory"]) - base
        ) / held
    return usage


# -- 3 and 4: renewal ---------------------------------------------------------------


def hold(client: Any, held: int, ttl: float, clock: FakeClock, prefix: str) -> list[Lease]:
    """Take ``held`` locks with pipelined ACQUIRE calls; return their leases."""
    names = [f"{prefix}:v1:{{t.job:{n}}}" for n in range(held)]
    tokens = [secrets.token_hex(16).encode() for _ in names]
    cluster = hasattr(client, "nodes_manager")
    client.script_load(ACQUIRE.source)
    leases = []
    for start in range(0, held, 5000):
        pipe = client.pipeline(transaction=False)
        for name, token in zip(names[start : start + 5000], tokens[start : start + 5000]):
            options = {"target_nodes": client.get_node_from_key(name)} if cluster else {}
            ACQUIRE.queue(
                pipe,
                (name, fence_key_for(name, cluster=cluster)),
                (token, int(ttl * 1000), 3_600_000, "0"),
                **options,
            )
        sent_at = clock()
        for name, token, fence in zip(
            names[start : start + 5000], tokens[start : start + 5000], pipe.execute()
        ):
            assert isinstance(fence, int), fence
            leases.append(
                Lease(client=client, name=name, token=token, fence=fence, ttl=ttl,
                      sent_at=sent_at, clock=clock)
            )  # fmt: skip
    return leases


def driven_periods(
    leases: list[Lease], clock: FakeClock, watchdog: Watchdog, periods: int, servers: list[Any]
) -> list[dict[str, Any]]:
    ttl = leases[0].ttl
    assert ttl is not None
    results = []
    for period in range(1, periods + 1):
        clock.now += ttl / 3
        before = [evalsha_calls(s) for s in servers]
        with counted_writes() as writes:
            start = time.process_time()
            watchdog.renew_due()
            cpu = time.process_time() - start
        after = [evalsha_calls(s) for s in servers]
        renewed = sum(1 for lease in leases if lease.renewals == period)
        results.append(
            {
                "cpu_ms": cpu * 1000,
                "writes": dict(writes),
                # INFO commandstats itself is not an EVALSHA; these are the pass's.
                "evalsha": [a - b for a, b in zip(after, before)],
                "renewed": renewed,
                "lost": sum(1 for lease in leases if lease.lost),
            }
        )
    return results


def single_redis_renewal(held: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with redis_server() as client:
        clock = FakeClock()
        watchdog = Watchdog(clock=clock)
        watchdog._thread = NeverStarted()  # type: ignore[assignment]
        leases = hold(client, held, 60.0, clock, "r1")
        for lease in leases:
            watchdog.watch(lease)
        client.script_load(RENEW.source)
        out["driven"] = driven_periods(leases, clock, watchdog, 15, [client])
        out["keys_alive"] = sum(1 for ttl in _pttls(client, [x.name for x in leases]) if ttl > 0)
        # The real thread, real time: 5 TTLs of 3 s.
        client.flushall()
        real = Watchdog()
        locks = hold(client, held, 3.0, FakeClock(), "r2")
        # Leases of the real clock: rebuilt with time.monotonic.
        now = time.monotonic()
        leases = [
            Lease(client=client, name=x.name, token=x.token, fence=x.fence, ttl=3.0,
                  sent_at=now, clock=time.monotonic)
            for x in locks
        ]  # fmt: skip
        cpu0 = time.process_time()
        for lease in leases:
            real.watch(lease)
        time.sleep(15.0)
        cpu = time.process_time() - cpu0
        out["threaded"] = {
            "seconds": 15.0,
            "lost": sum(1 for lease in leases if lease.lost),
            "min_renewals": min(lease.renewals for lease in leases),
            "keys_alive": sum(1 for t in _pttls(client, [x.name for x in leases]) if t > 0),
            "process_cpu_s": cpu,
        }
        for lease in leases:
            lease.released = True
    return out


def _pttls(client: redis.Redis, names: list[str]) -> list[int]:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.pttl(name)
    return [int(x) for x in pipe.execute()]


def cluster_renewal(held: int) -> dict[str, Any]:
    from redis.cluster import RedisCluster

    from tests.redis_topologies import LocalCluster

    with (
        tempfile.TemporaryDirectory(prefix="fp-cluster-") as workdir,
        LocalCluster(redis_server_binary(), Path(workdir)) as cluster,
    ):
        client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        clock = FakeClock()
        watchdog = Watchdog(clock=clock)
        watchdog._thread = NeverStarted()  # type: ignore[assignment]
        leases = hold(client, held, 60.0, clock, "c1")
        slots = {client.keyslot(lease.name) for lease in leases}
        for lease in leases:
            watchdog.watch(lease)
        client.script_load(RENEW.source)
        admins = [node.client() for node in cluster.nodes]
        periods = driven_periods(leases, clock, watchdog, 6, admins)
        keys = sum(admin.dbsize() for admin in admins)
        client.close()
        return {
            "held": held,
            "slots": len(slots),
            "masters": len(cluster.nodes),
            "ports": [node.port for node in cluster.nodes],
            "periods": periods,
            "keys": keys,
        }


# -- report -------------------------------------------------------------------------


def report(args: argparse.Namespace, fp: dict, mem: dict, single: dict, clu: dict) -> str:
    load = os.getloadavg()
    lines = [
        HEADING,
        "",
        f"Generated by `python bench/footprint_bench.py --distinct {args.distinct} --held "
        f"{args.held} --cluster-held {args.cluster_held} --rounds {args.rounds}` on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        "",
        f"- CPython {platform.python_version()}, redis-py {redis.__version__}, "
        f"{subprocess.run([redis_server_binary(), '--version'], capture_output=True, text=True).stdout.split()[2]}; "  # noqa: E501
        f"load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (2 shared CPUs).",
        "",
        "### Keys left by distinct completed calls (one private redis-server)",
        "",
        f"{args.distinct:,} `Lock` acquire+release cycles, each of a distinct name "
        "(a task's key: 64 hex digits in the hash tag); the same script, only the fence "
        "key differs.",
        "",
        "| fence key | keys left | used_memory growth |",
        "|---|---:|---:|",
    ]
    for label in ("per-name fence key (before)", "store counter (after)"):
        row = fp[label]
        lines.append(f"| {label} | {row['keys']:,} | {row['memory']:,} B |")
    before, after = fp["cycle_cpu"]["before"], fp["cycle_cpu"]["after"]
    ratios = fp["ratios"]
    lines += [
        "",
        f"Client CPU per acquire+release, {args.rounds} paired rounds of 1,000 cycles (order "
        f"alternating), same code with the fence key passed in (before) or the store's "
        f"(after): {statistics.median(before):.1f} vs {statistics.median(after):.1f} µs, "
        f"after/before per round {', '.join(f'{r:.3f}' for r in ratios)}, median "
        f"{statistics.median(ratios):.3f} (the caller builds the per-name key here, so "
        "this is not the revision comparison; that follows).",
        "",
    ]
    if args.revisions:
        rev = json.loads(Path(args.revisions).read_text())
        lines += [
            f"Lock cycle, previous revision vs this one (`{rev['command']}`, {rev['date']}; "
            f"old {rev['old']}, new {rev['new']}), callgrind instructions per call, "
            "deterministic:",
            "",
            "| measure | old | new | new/old |",
            "|---|---:|---:|---:|",
        ]
        for measure, counts in rev["instructions"].items():
            lines.append(
                f"| {measure} | {counts['old']:,.0f} | {counts['new']:,.0f} | "
                f"{counts['new'] / counts['old']:.3f} |"
            )
        lines.append("")
    lines += [
        "### Memory per held lock (`MEMORY USAGE`, bytes)",
        "",
        "| key | bytes |",
        "|---|---:|",
    ]
    for label, value in mem.items():
        lines.append(f"| {label} | {value:,.0f} |")
    lines += [
        "",
        f"A held task lock costs its one key; before, each distinct name also left its fence "
        f"key ({mem['per-name fence key (before)']} B) for an hour after its last use.",
        "",
        f"### Renewal of {args.held:,} held locks, one Redis",
        "",
        "Watchdog driven directly (`renew_due()`), fake clock advanced by a third of the "
        "60 s TTL per period, 15 periods (5 TTLs):",
        "",
        "| period | round trips | EVALSHA calls | locks renewed | lost | client CPU ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]

    for i, p in enumerate(single["driven"], 1):
        lines.append(
            f"| {i} | {sum(p['writes'].values())} | {p['evalsha'][0]} | {p['renewed']:,} | "
            f"{p['lost']} | {p['cpu_ms']:.1f} |"
        )
    cpus = [p["cpu_ms"] for p in single["driven"]]
    t = single["threaded"]
    lines += [
        "",
        f"Client CPU per period: median **{statistics.median(cpus):.1f} ms**, max "
        f"{max(cpus):.1f} ms (target ≤ 30 ms; a single period above it is the shared "
        "machine, see the load). Period 1 also opens the renewal connection (its "
        "handshake commands are the extra writes) and encodes each lease's part of the "
        f"call once. Keys alive after the run: {single['keys_alive']:,}.",
        "",
        f"The watchdog thread itself, real time, TTL 3 s, {t['seconds']:.0f} s (5 TTLs): "
        f"{t['lost']} lost, every lock renewed at least {t['min_renewals']} times, "
        f"{t['keys_alive']:,} keys alive at the end; process CPU {t['process_cpu_s']:.2f} s "
        f"for {t['seconds'] / 1.0:.0f} s ({t['process_cpu_s'] / (t['seconds'] / 1.0) * 1000:.1f}"
        " ms per second).",
        "",
        f"### Renewal of {clu['held']:,} held locks, Redis Cluster with {clu['masters']} masters",
        "",
        f"Keys over {clu['slots']:,} slots; watchdog driven directly, 6 periods of a third "
        "of the 60 s TTL:",
        "",
        "| period | round trips per master | EVALSHA calls per master | locks renewed | lost "
        "| client CPU ms |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for i, p in enumerate(clu["periods"], 1):
        per_master = ", ".join(str(p["writes"].get(port, 0)) for port in clu["ports"])
        lines.append(
            f"| {i} | {per_master} | {', '.join(map(str, p['evalsha']))} | {p['renewed']:,} | "
            f"{p['lost']} | {p['cpu_ms']:.0f} |"
        )
    lines += [
        "",
        "One pipelined write per master per period; one `RENEW` call per slot inside it "
        "(a script touches one slot). Before this change a Cluster client's leases were "
        "renewed one by one: a round trip per lock per period.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--distinct", type=int, default=20_000)
    parser.add_argument("--held", type=int, default=10_000)
    parser.add_argument("--cluster-held", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--results", default=str(Path(__file__).parent / "RESULTS.md"))
    parser.add_argument(
        "--revisions", default=None, help="JSON written by bench/revisions.py --json, to include"
    )
    args = parser.parse_args()
    fp = footprint(args.distinct, args.rounds)
    mem = memory_per_lock(args.held)
    single = single_redis_renewal(args.held)
    clu = cluster_renewal(args.cluster_held)
    text = report(args, fp, mem, single, clu)
    print(text)
    if args.results != "-":
        write_section(Path(args.results), HEADING, text)


if __name__ == "__main__":
    main()
