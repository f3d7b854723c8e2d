"""One command's round trip: ``sendall()`` against the lock's one ``write()``, paired per round.

Run from the repository root, with the project's virtualenv::

    python bench/write_bench.py [--rounds 21] [--calls 5000]

redis-py 8 gives every connection a socket timeout (5 s), and Python polls a
socket with a timeout before each ``send()``. A lock's scripts are written
with one ``write()`` instead (``core/sockets._write_all``): one system call
less per command, two per task. Both sides here send the same ``PING`` on
the same socket of a private redis-server and read its reply the same way
(``recv_into`` and a hiredis reader); only the write differs. Each round
times ``--calls`` round trips of each side back to back, the order
alternating; reported are the medians of the per-round ratios, wall and CPU.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import hiredis

ROOT = Path(__file__).resolve().parent.parent
PING = b"*1\r\n$4\r\nPING\r\n"


def round_trip(
    sock: socket.socket, write: Callable[[socket.socket, bytes], None]
) -> Callable[[], object]:
    """A ``PING`` written with ``write`` on ``sock``, its reply read with ``recv_into``."""
    reader = hiredis.Reader()
    buffer = bytearray(65536)

    def call() -> object:
        write(sock, PING)
        reply = reader.gets()
        while reply is False:
            read = sock.recv_into(buffer)
            reader.feed(buffer, 0, read)
            reply = reader.gets()
        return reply

    return call


def timed(call: Callable[[], object], calls: int) -> tuple[float, float]:
    """Wall and CPU µs per call over ``calls`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    return (
        (time.perf_counter() - wall) / calls * 1e6,
        (time.process_time() - cpu) / calls * 1e6,
    )


def main(argv: list[str] | None = None) -> int:
    """Time both writes in paired rounds and print a Markdown summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=21, help="paired rounds")
    parser.add_argument("--calls", type=int, default=5000, help="round trips per side and round")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench.task_bench import private_redis
    from celery_redlock.core.sockets import _write_all

    with (
        tempfile.TemporaryDirectory(prefix="write-bench-") as tmp,
        private_redis(Path(tmp), "redis") as url,
    ):
        parts = urlsplit(url)
        sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(5.0)  # redis-py 8's default socket_timeout
        sides = {
            "sendall": round_trip(sock, socket.socket.sendall),
            "write": round_trip(sock, _write_all),
        }
        for call in sides.values():
            timed(call, 500)  # warm-up
        rounds: list[dict[str, tuple[float, float]]] = []
        for number in range(args.rounds):
            order = list(sides) if number % 2 else list(reversed(sides))
            rounds.append({name: timed(sides[name], args.calls) for name in order})
        sock.close()
    wall = statistics.median(r["write"][0] / r["sendall"][0] for r in rounds)
    cpu = statistics.median(r["write"][1] / r["sendall"][1] for r in rounds)
    print(f"{args.rounds} paired rounds of {args.calls} PING round trips each:\n")
    print("| write | wall µs (median) | CPU µs (median) |")
    print("|---|---:|---:|")
    for name in sides:
        print(
            f"| {name} | {statistics.median(r[name][0] for r in rounds):.1f} "
            f"| {statistics.median(r[name][1] for r in rounds):.1f} |"
        )
    print(f"\nwrite/sendall, median of the per-round ratios: wall {wall:.3f}, CPU {cpu:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
