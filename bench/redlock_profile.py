"""Where an uncontended Redlock acquire+release cycle spends its client CPU.

Run from the repository root::

    python bench/redlock_profile.py [--contender redlock5] [--cycles N] [--cprofile]

Five private ``redis-server`` processes are started on free loopback ports (see
``lock_bench.private_redis_server``) and stopped by their pids at the end. The
chosen contender runs ``--warmup`` cycles, then ``--cycles`` measured ones:

- with ``--cprofile``, under ``cProfile``, printing the top functions by own time;
- with ``--callgrind``, twice under ``valgrind --tool=callgrind`` (this script
  again, with ``--cycles`` and ``2 * --cycles`` measured cycles), printing the
  difference in client instructions divided by the difference in cycles, which
  cancels start-up, imports and warm-up. Instruction counts, unlike timings,
  stay put on a loaded machine. Only the client process is counted: the
  servers and the kernel's share of the client are not.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import os
import pstats
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import redis

BENCH = Path(__file__).resolve().parent
for path in (BENCH, BENCH.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from fanout_floor import FanoutFloor  # noqa: E402
from lock_bench import BenchError, private_redis_server  # noqa: E402

import celery_redlock  # noqa: E402

TTL_SECONDS = 10
CONTENDERS = ("lock", "redlock3", "redlock5", "redlock5-nofence", "floor5")


def cycle_for(name: str, clients: list[redis.Redis], ports: list[int]) -> Callable[[], None]:
    """One acquire+release cycle of contender ``name``."""
    if name == "floor5":
        return FanoutFloor(ports, "profile:floor5").cycle
    lock: Any
    if name == "lock":
        lock = celery_redlock.Lock(clients[0], "profile:lock", timeout=TTL_SECONDS)
    else:
        masters = clients[:3] if name == "redlock3" else clients
        lock = celery_redlock.Redlock(
            masters, f"profile:{name}", timeout=TTL_SECONDS, fencing=not name.endswith("nofence")
        )
    acquire = functools.partial(lock.acquire, blocking=False)

    def cycle() -> None:
        if not acquire():
            raise BenchError(f"{lock!r}: an uncontended acquire failed")
        lock.release()

    return cycle


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contender", choices=CONTENDERS, default="redlock5")
    parser.add_argument("--cycles", type=int, default=2000, help="measured cycles")
    parser.add_argument("--warmup", type=int, default=200, help="cycles before measuring")
    parser.add_argument("--cprofile", action="store_true", help="profile with cProfile")
    parser.add_argument("--top", type=int, default=30, help="functions shown by --cprofile")
    parser.add_argument(
        "--callgrind", action="store_true", help="count instructions per cycle with callgrind"
    )
    return parser.parse_args(argv)


def callgrind_instructions(args: argparse.Namespace, cycles: int, workdir: str) -> int:
    """Instructions the client process executes for a whole run of ``cycles`` cycles."""
    out = os.path.join(workdir, f"callgrind.{cycles}.out")
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    argv += [sys.executable, __file__, "--contender", args.contender]
    argv += ["--cycles", str(cycles), "--warmup", str(args.warmup)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as lines:
        for line in lines:
            found = re.match(r"(?:summary|totals): (\d+)", line)
            if found:
                return int(found.group(1))
    raise BenchError(f"no instruction total in {out}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.callgrind:
        with tempfile.TemporaryDirectory(prefix="redlock-callgrind-") as workdir:
            short = callgrind_instructions(args, args.cycles, workdir)
            long = callgrind_instructions(args, 2 * args.cycles, workdir)
        per_cycle = (long - short) / args.cycles
        print(f"{args.contender}: {per_cycle:,.0f} instructions per cycle (client, user space)")
        return 0
    with contextlib.ExitStack() as servers:
        ports = [servers.enter_context(private_redis_server()) for _ in range(5)]
        clients = [redis.Redis(host="127.0.0.1", port=port) for port in ports]
        cycle = cycle_for(args.contender, clients, ports)
        for _ in range(args.warmup):
            cycle()
        if args.cprofile:
            profile = cProfile.Profile()
            profile.enable()
        for _ in range(args.cycles):
            cycle()
        if args.cprofile:
            profile.disable()
            stats = pstats.Stats(profile).sort_stats("tottime")
            stats.print_stats(args.top)
        for client in clients:
            client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
