"""What recording the rate beside a rate key costs an admission (the operator's ``used/limit``).

Run from the repository root::

    .venv/bin/python bench/rate_spec_bench.py [--rounds 7] [--calls 20000]

Each admission of :data:`celery_redlock.core.rate.RATE_ACQUIRE` now also keeps
the rate its caller uses in the key's ``:spec`` companion (rewritten once per
window), so ``celery redlock list`` and the dashboard can show ``used/limit``.
This compares it with the same script without that record on a private
``redis-server``, side by side:
each round runs ``--calls`` admissions of each (alternating which goes first)
and reads the server's own time per call (``INFO commandstats``, reset with
``CONFIG RESETSTAT`` on this private server only), so the client and a busy
machine's scheduling do not enter the measure. Round trips per admission are
counted on the connection. The result is the median ratio of the paired rounds.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from results import write_section  # noqa: E402

from celery_redlock.core.lua import Script  # noqa: E402
from celery_redlock.core.rate import RATE_ACQUIRE, Rate, RateLimiter, rate_keys_of  # noqa: E402
from tests.redis_servers import RedisServer, find_redis_server_binary  # noqa: E402

HEADING = "## Rate check: recording the rate for the operator's view"
SPEC_LINES = (
    "  if redis.call('PTTL', KEYS[3]) < window then\n"
    "    redis.call('SET', KEYS[3], ARGV[1] .. ' ' .. ARGV[2], 'PX', 2 * window)\n"
    "  end\n"
)

#: The admission script as it was before it recorded the rate.
WITHOUT_SPEC = Script("rate_acquire_without_spec", RATE_ACQUIRE.source.replace(SPEC_LINES, ""))


def server_usec_per_call(client: redis.Redis) -> float:
    """The server's own microseconds per script call since the last reset."""
    stats = client.info("commandstats")
    calls = usec = 0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        if name in stats:
            calls += int(stats[name]["calls"])
            usec += int(stats[name]["usec"])
    return usec / calls


def run(client: redis.Redis, script: Script, key: str, calls: int) -> float:
    """``calls`` admissions to ``key`` (a limit never reached); the server's µs per call."""
    client.config_resetstat()
    keys = rate_keys_of(key)
    for n in range(calls):
        script(client, keys, (10**9, 1000, f"m{n}", "0"))
    return server_usec_per_call(client)


def round_trips(client: redis.Redis) -> float:
    """Commands sent on the connection per ``RateLimiter.acquire``."""
    limiter = RateLimiter(client, Rate(10**6, 60.0))
    limiter.acquire("bench:rate:{trips}")
    sent = 0
    connection_class = redis.connection.AbstractConnection
    original = connection_class.send_command

    def counting(self: object, *args: object, **kwargs: object) -> None:
        nonlocal sent
        sent += 1
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    connection_class.send_command = counting  # type: ignore[method-assign]
    try:
        for _ in range(100):
            limiter.acquire("bench:rate:{trips}")
    finally:
        connection_class.send_command = original  # type: ignore[method-assign]
    return sent / 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    binary = find_redis_server_binary()
    assert binary, "no redis-server found"
    with (
        tempfile.TemporaryDirectory() as workdir,
        RedisServer(binary, workdir=Path(workdir)) as server,
    ):
        client = server.client()
        for script in (RATE_ACQUIRE, WITHOUT_SPEC):
            run(client, script, "bench:rate:{warm}", 1000)
        rounds = []
        for i in range(args.rounds):
            order = [("with", RATE_ACQUIRE), ("without", WITHOUT_SPEC)]
            if i % 2:
                order.reverse()
            times = {
                name: run(client, script, f"bench:rate:{{{name}}}", args.calls)
                for name, script in order
            }
            rounds.append(times)
        trips = round_trips(client)
        client.close()
    ratios = [r["with"] / r["without"] for r in rounds]
    section = "\n".join(
        [
            HEADING,
            "",
            f"Written by `bench/rate_spec_bench.py` on {datetime.date.today()} "
            f"({platform.machine()}, Python {platform.python_version()}, a private redis-server).",
            "",
            "| measure | value |",
            "| --- | ---: |",
            f"| round trips per rate check (`RateLimiter.acquire`) | {trips:g} |",
            f"| paired rounds x admissions each | {args.rounds} x {args.calls} |",
            f"| server µs per admission, without the `:spec` write (median) | "
            f"{statistics.median(r['without'] for r in rounds):.2f} |",
            f"| server µs per admission, with it (median) | "
            f"{statistics.median(r['with'] for r in rounds):.2f} |",
            f"| ratio with / without, median of paired rounds | {statistics.median(ratios):.3f} |",
            f"| ratio range over the rounds | {min(ratios):.3f} to {max(ratios):.3f} |",
            "",
            "The time is the server's own (`INFO commandstats`), so it leaves out the",
            "network and the client; an admission stays one round trip. An admission",
            "reads the record's TTL and rewrites it (for two windows) only once it has",
            "less than a window left; a refused call touches it not at all.",
        ]
    )
    write_section(ROOT / "bench" / "RESULTS.md", HEADING, section)
    print(section)


if __name__ == "__main__":
    main()
