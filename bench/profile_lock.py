"""Where an acquire+release cycle of celery_redlock.Lock spends its time, client and server.

Run from the repository root::

    python bench/profile_lock.py [--calls N]

Two parts, each compared with what the raw floor of ``bench/lock_bench.py``
(``client.set(nx, px)`` + ``client.evalsha``) pays for the same step:

1. client side, without Redis: the lock's Python code timed against a stub
   client whose ``execute_command`` returns at once (best of 5 ``timeit``
   repeats, µs per call); redis-py's own ``set()``/``evalsha()`` wrappers timed
   the same way;
2. server side: ``INFO commandstats`` µs per call of the acquire and release
   scripts on a private redis-server (see ``lock_bench.private_redis_server``),
   next to a plain ``SET NX PX`` and the floor's compare-and-delete script.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
import timeit
from collections.abc import Sequence
from typing import Any, Callable

import redis
from lock_bench import RAW_RELEASE_LUA, TTL_MS, TTL_SECONDS, private_redis_server

import celery_redlock
from celery_redlock.core.lease import Lease
from celery_redlock.core.scripts import ACQUIRE, RELEASE

TOKEN = secrets.token_hex(16).encode()


class StubClient:
    """Answers every command at once: 1, which both scripts read as success."""

    def execute_command(self, *args: Any, **options: Any) -> int:
        return 1

    def set(self, *args: Any, **options: Any) -> bool:
        return True


class StubRedis(redis.Redis):
    """redis-py's command methods over a stub ``execute_command``."""

    def __init__(self) -> None:  # no connection pool
        pass

    def execute_command(self, *args: Any, **options: Any) -> int:
        return 1


def best_us(fn: Callable[[], object], number: int) -> float:
    """Best of 5 repeats of ``number`` calls, in µs per call."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def client_side(number: int) -> list[tuple[str, float]]:
    stub = StubClient()
    fenced = celery_redlock.Lock(stub, "p", timeout=TTL_SECONDS)
    plain = celery_redlock.Lock(stub, "q", timeout=TTL_SECONDS, fencing=False)
    rstub = StubRedis()

    def fenced_cycle() -> None:
        fenced.acquire()
        fenced.release()

    def plain_cycle() -> None:
        plain.acquire()
        plain.release()

    def release_only() -> None:
        fenced.local.token = TOKEN
        fenced.release()

    rows: list[tuple[str, Callable[[], object]]] = [
        ("lock.py Lock.acquire+release (fencing)", fenced_cycle),
        ("lock.py Lock.acquire+release (fencing=False)", plain_cycle),
        ("lock.py Lock.do_acquire (fencing)", lambda: fenced.do_acquire(TOKEN)),
        ("lock.py Lock.release", release_only),
        (
            "lock.py Lease.__init__",
            lambda: Lease(
                client=stub,
                name="p",
                token=TOKEN,
                fence=1,
                ttl=10.0,
                sent_at=1.0,
                clock=time.monotonic,
                owner=fenced,
            ),
        ),
        (
            "scripts.py Script.__call__",
            lambda: ACQUIRE(stub, ("p", "{p}:fence"), (TOKEN, 1, 1, "0")),
        ),
        ("secrets.token_hex(16).encode()", lambda: secrets.token_hex(16).encode()),
        ("floor: secrets.token_hex(16)", lambda: secrets.token_hex(16)),
        ("floor: redis-py Redis.set(nx, px)", lambda: rstub.set("k", "t", nx=True, px=TTL_MS)),
        ("floor: redis-py Redis.evalsha", lambda: rstub.evalsha("0" * 40, 1, "k", "t")),
    ]
    return [(label, best_us(fn, number)) for label, fn in rows]


def usec_per_call(admin: redis.Redis, command: str, run: Callable[[], object], calls: int) -> float:
    admin.config_resetstat()
    for _ in range(calls):
        run()
    return float(admin.info("commandstats")[f"cmdstat_{command}"]["usec_per_call"])


def server_side(port: int, calls: int) -> list[tuple[str, float]]:
    client = redis.Redis(host="127.0.0.1", port=port)
    admin = redis.Redis(host="127.0.0.1", port=port)
    sha = client.script_load(RAW_RELEASE_LUA)
    ACQUIRE(client, ("s", "{s}:fence"), (TOKEN, TTL_MS, 3_600_000, "0"))  # caches the scripts
    RELEASE(client, ("s",), (TOKEN, "0"))

    def fenced_acquire() -> None:
        ACQUIRE(client, ("s", "{s}:fence"), (TOKEN, TTL_MS, 3_600_000, "0"))
        client.delete("s")

    def release() -> None:
        client.set("s", TOKEN)
        RELEASE(client, ("s",), (TOKEN, "0"))

    def plain_set() -> None:
        client.set("s", TOKEN, nx=True, px=TTL_MS)
        client.delete("s")

    def floor_release() -> None:
        client.set("s", TOKEN)
        client.evalsha(sha, 1, "s", TOKEN)

    rows = [
        ("scripts.py ACQUIRE (EVALSHA, fenced)", "evalsha", fenced_acquire),
        ("scripts.py RELEASE (EVALSHA)", "evalsha", release),
        ("floor: SET NX PX", "set", plain_set),
        ("floor: compare-and-delete EVALSHA", "evalsha", floor_release),
    ]
    return [(label, usec_per_call(admin, cmd, run, calls)) for label, cmd, run in rows]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per measurement")
    args = parser.parse_args(argv)
    print("| client side, stub Redis | µs per call |\n|---|---:|")
    for label, us in client_side(max(1, args.calls * 10)):
        print(f"| {label} | {us:.2f} |")
    with private_redis_server() as port:
        print("\n| server side, INFO commandstats | µs per call |\n|---|---:|")
        for label, us in server_side(port, max(1, args.calls)):
            print(f"| {label} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
