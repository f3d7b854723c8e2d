"""Rate limits: the cost of one check, and the throughput of a 20/s limit across two workers.

Run from the repository root, with Redis on 127.0.0.1:6379 (``scripts/test``
starts one)::

    .venv/bin/python bench/rate_bench.py [--calls 300] [--checks 2000]

1. Round trips and latency of one rate check (``RateLimiter.acquire``): the
   commands sent on the connection are counted, and the median of ``--checks``
   checks on loopback is reported.
2. ``--calls`` calls of ``rates.call`` (``lock_rate="20/s"`` on one account,
   ``lock_on_conflict="requeue"``) sent at once to two real prefork workers
   with four processes each (tests/celery_apps/storm.py). Throughput is the
   admissions per second between the first and the last admission (server
   clock); the window check counts the most admissions in any 1 s interval.
   The longest wait is from publishing to admission.

Everything lives in Redis db 9 under a fresh prefix, deleted at the end; the
workers are stopped by pid.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from results import write_section  # noqa: E402

from celery_redlock.core.rate import Rate, RateLimiter  # noqa: E402
from tests.celery_apps import storm  # noqa: E402
from tests.celery_harness import (  # noqa: E402
    REDIS_URL,
    CeleryWorker,
    History,
    delete_prefixed_keys,
    start_all,
    task_states,
    wait_until,
)

HEADING = "## Rate limits"


def check_cost(client: redis.Redis, prefix: str, checks: int) -> tuple[float, float]:
    """(round trips per check, median µs per check) of ``RateLimiter.acquire``."""
    limiter = RateLimiter(client, Rate(checks * 2, 60.0))
    key = f"{prefix}:rate:{{bench}}"
    limiter.acquire(key)  # load the script
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
            limiter.acquire(key)
        trips = sent / 100
    finally:
        connection_class.send_command = original  # type: ignore[method-assign]
    times = []
    for _ in range(checks):
        start = time.perf_counter()
        limiter.acquire(key)
        times.append(time.perf_counter() - start)
    return trips, statistics.median(times) * 1e6


def most_in_window(starts: list[int], window_ms: int) -> int:
    ordered, most, first = sorted(starts), 0, 0
    for last, start in enumerate(ordered):
        while ordered[first] <= start - window_ms:
            first += 1
        most = max(most, last - first + 1)
    return most


def throughput(client: redis.Redis, prefix: str, calls: int, log_dir: Path) -> dict[str, float]:
    env = storm.environment(broker=REDIS_URL, backend=REDIS_URL, prefix=prefix, queue=f"{prefix}.q")
    app = storm.create_app(env)
    workers = [
        CeleryWorker(
            "tests.celery_apps.storm",
            pool="prefork",
            concurrency=4,
            queues=[f"{prefix}.q"],
            nodename=f"rate{n}-{prefix}@bench",
            log_dir=log_dir,
            env=env,
        )
        for n in range(2)
    ]
    try:
        start_all(workers, 60)
        call = app.tasks["rates.call"]
        published = time.time()
        with app.producer_or_acquire() as producer:
            ids = [call.apply_async((i, "acct"), producer=producer).id for i in range(calls)]
        wait_until(
            lambda: all(s == "SUCCESS" for s, _ in task_states(app, ids).values()),
            300,
            interval=0.2,
            message="every call to succeed",
        )
        done = time.time()
    finally:
        for worker in workers:
            worker.request_stop()
        for worker in workers:
            worker.stop()
        app.close()
    runs = [e for e in History(client, prefix).executions() if e.name == "rates.call"]
    admitted = sorted(e.extra["admitted_ms"] for e in runs)
    return {
        "runs": len(runs),
        "distinct": len({e.task_id for e in runs}),
        "rate": (len(admitted) - 1) * 1000 / (admitted[-1] - admitted[0]),
        "most_per_second": most_in_window(admitted, 1000),
        "longest_wait": max(e.start for e in runs) - published,
        "end_to_end": done - published,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--checks", type=int, default=2000)
    args = parser.parse_args()
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"rlb-{uuid.uuid4().hex[:10]}"
    try:
        trips, micros = check_cost(client, prefix, args.checks)
        with tempfile.TemporaryDirectory() as logs:
            result = throughput(client, prefix, args.calls, Path(logs))
    finally:
        delete_prefixed_keys(client, prefix)
    today = datetime.date.today().isoformat()
    within = abs(result["rate"] - 20) <= 2
    section = f"""{HEADING}

Written by `bench/rate_bench.py` on {today} ({platform.machine()}, {os.cpu_count()} cores,
Python {platform.python_version()}, Redis on loopback).

| measure | value |
| --- | ---: |
| round trips per rate check (`RateLimiter.acquire`) | {trips:g} |
| median rate check, loopback | {micros:.0f} µs |
| calls of `lock_rate="20/s"` on one key, 2 prefork workers, -c 4 | {args.calls} |
| executions / distinct calls | {result["runs"]} / {result["distinct"]} |
| admissions per second, first to last | {result["rate"]:.2f} (within 10 % of 20: {within}) |
| most admissions in any 1 s window (server clock) | {result["most_per_second"]} |
| longest wait, publish to start | {result["longest_wait"]:.1f} s |
| publish to last result | {result["end_to_end"]:.1f} s |

Calls over the limit are requeued with the exact wait until a slot frees plus
up to half the window of jitter; each requeue costs a republish, not a poll.
"""
    write_section(ROOT / "bench" / "RESULTS.md", HEADING, section)
    print(section)


if __name__ == "__main__":
    main()
