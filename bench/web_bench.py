"""How fast the dashboard answers with 10,000 held locks in the store.

Run from the repository root::

    python bench/web_bench.py [--locks 10000] [--requests 20]

A private ``redis-server`` gets ``--locks`` task locks (values as workers
write them, with fence keys, over 20 task names and 3 queues) plus 500
enqueue reservations. The dashboard (``celery_redlock.ops.web.create_app``,
served by the same werkzeug server as ``celery redlock web``, on a free
loopback port) is then asked over HTTP, each page ``--requests`` times:
the first locks page (the first request of all is timed on its own: the
cold start), a page of one task, a queue filter that keeps one lock in
three, a key text that matches one lock, the tenth page of the unfiltered
list, and ``/metrics`` (which counts every key with SCAN; no worker
answers, so the broadcast costs its full timeout of 0.2 s). Median and worst
times are reported. Writes the ``## Dashboard with 10,000 locks`` section of
``bench/RESULTS.md``. The redis-server started here is stopped by its pid.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import redis
from celery import Celery
from results import write_section
from task_bench import private_redis
from werkzeug.serving import make_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_redlock.core.holder import Holder
from celery_redlock.ops.web import create_app

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Dashboard with 10,000 locks"
TASKS = [f"bench.task{n:02d}" for n in range(20)]
QUEUES = ("q1", "q2", "q3")


def plant(url: str, locks: int) -> None:
    client = redis.Redis.from_url(url)
    pipe = client.pipeline(transaction=False)
    for n in range(locks):
        task = TASKS[n % len(TASKS)]
        key = f"redlock:v1:{{{task}:{n:064x}}}"
        holder = Holder.new(f"task-{n}", f"worker{n % 8}@bench", ttl=3600, queue=QUEUES[n % 3])
        pipe.set(key, holder.encode(), px=3_600_000)
        pipe.set(f"{key}:fence", n + 1, px=3_600_000)
        if n < 500:
            pipe.set(
                f"redlock:v1:{{{task}:{n + locks:064x}}}:queued", holder.encode(), px=3_600_000
            )
        if n % 1000 == 999:
            pipe.execute()
    pipe.execute()
    client.close()


def timed(url: str) -> tuple[float, int]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read()
        assert response.status == 200
    return time.perf_counter() - start, len(body)


def tenth_page(base: str) -> str:
    path = "/"
    for _ in range(9):
        with urllib.request.urlopen(base + path, timeout=30) as response:
            text = response.read().decode()
        marker = 'id="next-page"'
        head = text[: text.index(marker)]
        path = head[head.rindex('href="') + 6 :].split('"')[0].replace("&amp;", "&")
    return path


def run(locks: int, requests: int) -> str:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    with tempfile.TemporaryDirectory() as tmp, private_redis(Path(tmp), "store") as url:
        plant(url, locks)
        app = Celery("web-bench", broker="memory://", set_as_current=False)
        app.conf.update(redlock_url=url)
        web = create_app(app, ping_timeout=0.2, refresh=0)
        server = make_server("127.0.0.1", 0, web, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        base = f"http://127.0.0.1:{server.port}"
        try:
            cold, size = timed(base + "/")
            pages = {
                "first page (50 locks)": "/",
                "one task (`?task=task07`)": "/?task=task07",
                "queue filter (`?queue=q2`)": "/?queue=q2",
                "key text matching one lock": f"/?key={7777:064x}",
                "tenth page": tenth_page(base),
                "`/metrics` (SCAN-counts every key)": "/metrics",
            }
            rows = []
            for label, path in pages.items():
                times = [timed(base + path)[0] for _ in range(requests)]
                rows.append((label, statistics.median(times), max(times)))
        finally:
            server.shutdown()
            server.server_close()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    lines = [
        HEADING,
        "",
        f"Written by `bench/web_bench.py` on {datetime.date.today()} ({machine}, "
        f"Python {platform.python_version()}, {locks} locks + 500 reservations, "
        f"{requests} requests per page, one private redis-server on loopback).",
        "",
        f"Cold first request of the locks page: **{cold * 1000:.0f} ms** ({size} bytes).",
        "",
        "| page | median | worst |",
        "| --- | ---: | ---: |",
        *(
            f"| {label} | {med * 1000:.1f} ms | {worst * 1000:.1f} ms |"
            for label, med, worst in rows
        ),
        "",
        "Target: the first page under 1 s with 10,000 locks. A page reads only what it shows:",
        "one SCAN batch and one pipelined read of 50 values, whatever the store holds.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locks", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=20)
    options = parser.parse_args()
    section = run(options.locks, options.requests)
    print(section)
    write_section(ROOT / "bench" / "RESULTS.md", HEADING, section)


if __name__ == "__main__":
    main()
