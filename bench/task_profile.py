"""Where a task's time goes, in-process: the evidence behind the task benchmark's findings.

Run from the repository root::

    python bench/task_profile.py [--tasks 1500]

No worker: each task is run through Celery's own tracer (``build_tracer``, the
code a pool process runs, storing results in the backend, with the worker's
``setup_worker_optimizations`` applied), so the numbers are
the per-task cost inside one pool process without the broker, IPC and
scheduling. It starts a private ``redis-server`` (result backend and lock
store; binary from ``$REDLOCK_TEST_REDIS_SERVER`` or ``PATH``) and stops it by
its pid. Prints:

1. µs per traced task (wall and CPU, median of interleaved repeats): the plain
   task, ``SingletonTask`` (also with the renewal watchdog's ``watch`` made a
   no-op, to show what registering every lease costs), celery-once and
   celery-singleton, and the bare cost of the lock's two scripts for reference;
2. the skip path: a ``SingletonTask`` call whose lock is held, the same with
   Celery's ``ExceptionInfo`` replaced by a stub, and a plain task that raises
   ``Ignore`` — what share of a skip is Celery's handling of ``Ignore``;
3. memory a finished ``SingletonTask`` keeps alive: 200 calls with a 1 MB
   argument, then the traced memory right after them and after ``ttl / 3``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.task_bench import private_redis  # noqa: E402


def per_call(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """Return (wall µs, CPU µs) per call of ``fn`` over ``calls`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (
        (time.perf_counter() - wall) / calls * 1e6,
        (time.process_time() - cpu) / calls * 1e6,
    )


def interleaved(
    variants: dict[str, Callable[[], object]],
    calls: int,
    repeats: int = 7,
    before: Callable[[str], None] | None = None,
) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) µs per call of each variant over interleaved repeats."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for name, fn in variants.items():  # warm-up
        if before:
            before(name)
        per_call(fn, max(1, calls // 10))
    for _ in range(repeats):
        for name, fn in variants.items():
            if before:
                before(name)
            samples[name].append(per_call(fn, calls))
    return {
        name: (
            statistics.median(s[0] for s in runs),
            statistics.median(s[1] for s in runs),
        )
        for name, runs in samples.items()
    }


@contextmanager
def environment() -> Iterator[tuple[Any, str]]:
    """Yield the benchmark app bound to a private redis-server, and the server's URL."""
    with (
        tempfile.TemporaryDirectory(prefix="task-profile-") as tmp,
        private_redis(Path(tmp), "redis") as url,
    ):
        os.environ.update(BENCH_TASK_BROKER=url, BENCH_TASK_LOCK_URL=url)
        from bench.task_app import app

        yield app, url


def main(argv: list[str] | None = None) -> int:
    """Run the three measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1500, help="calls per variant and repeat")
    args = parser.parse_args(argv)
    calls = args.tasks

    with environment() as (app, url):
        import celery.app.trace as celery_trace
        from celery.exceptions import Ignore

        from celery_redlock import SingletonTask
        from celery_redlock.guard import guard_for
        from celery_redlock.renewal import Watchdog, default_watchdog
        from celery_redlock.scripts import ACQUIRE, RELEASE

        @app.task(name="bench.profile.ignore")  # type: ignore[untyped-decorator]
        def raises_ignore() -> None:
            raise Ignore()

        @app.task(  # type: ignore[untyped-decorator]
            name="bench.profile.payload", base=SingletonTask, lock_key=["i"]
        )
        def payload(i: int, blob: str) -> None:
            return None

        # As in a worker: finalize, and patch Task.__call__ so that a custom
        # __call__ calling super() (as SingletonTask does) runs the body directly.
        celery_trace.setup_worker_optimizations(app, hostname="profile")
        counter = iter(range(10**9))

        def traced(name: str, make_args: Callable[[], tuple[Any, ...]]) -> Callable[[], object]:
            tracer = celery_trace.build_tracer(name, app.tasks[name], app=app, eager=False)

            def call() -> object:
                task_id = str(uuid.uuid4())
                task_args = make_args()
                request = {"id": task_id, "hostname": "profile", "args": task_args, "kwargs": {}}
                return tracer(task_id, task_args, {}, request)

            return call

        def distinct() -> tuple[Any, ...]:
            return (next(counter),)

        client = redis.Redis.from_url(url)

        def two_scripts() -> None:
            key = f"profile:{next(counter)}"
            ACQUIRE(client, (key, key + ":fence"), (b"token", 10000, 3600000))
            RELEASE(client, (key,), (b"token",))

        real_watch = Watchdog.watch

        def no_watch(self: Watchdog, lease: Any) -> None:
            return None

        def pick_watch(name: str) -> None:
            Watchdog.watch = no_watch if "no-op" in name else real_watch  # type: ignore[method-assign]

        print("1. per traced task, µs (wall / CPU), median of interleaved repeats")
        redlock = traced("bench.redlock", distinct)
        results = interleaved(
            {
                "plain @app.task": traced("bench.plain", distinct),
                "SingletonTask": redlock,
                "SingletonTask, Watchdog.watch a no-op": redlock,
                "celery-once QueueOnce (worker side)": traced("bench.once", distinct),
                "celery-singleton Singleton (worker side)": traced("bench.singleton", distinct),
                "bare ACQUIRE + RELEASE scripts": two_scripts,
            },
            calls,
            before=pick_watch,
        )
        Watchdog.watch = real_watch  # type: ignore[method-assign]
        for name, (wall, cpu) in results.items():
            print(f"   {name:42s} {wall:7.0f} / {cpu:7.0f}")

        print("2. skip path, µs per call (wall / CPU)")
        hold = app.tasks["bench.hold"]
        client.set(hold.lock_key_for("profile", 60.0), "v1|token|holder|profile|1", px=600_000)
        real_einfo = celery_trace.ExceptionInfo

        class StubExceptionInfo:
            """Just what the tracer reads from an ExceptionInfo, without copying frames."""

            internal = True
            traceback = ""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.exc_info: tuple[Any, Any, Any] = sys.exc_info()
                self.type: Any = self.exc_info[0]
                self.exception: Any = self.exc_info[1]
                self.tb: Any = self.exc_info[2]

        def choose(name: str) -> None:
            stub = "stubbed" in name
            celery_trace.ExceptionInfo = StubExceptionInfo if stub else real_einfo

        skip = traced("bench.hold", lambda: ("profile", 60.0))
        results = interleaved(
            {
                "SingletonTask skip (lock held)": skip,
                "same, Celery's ExceptionInfo stubbed": skip,
                "plain task raising Ignore": traced("bench.profile.ignore", tuple),
            },
            max(1, calls // 3),
            before=choose,
        )
        celery_trace.ExceptionInfo = real_einfo
        for name, (wall, cpu) in results.items():
            print(f"   {name:42s} {wall:7.0f} / {cpu:7.0f}")

        print("3. memory kept alive by finished SingletonTask calls (1 MB argument each)")
        blob_calls = traced("bench.profile.payload", lambda: (next(counter), "x" * 1_000_000))
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            blob_calls()
        gc.collect()
        held = (tracemalloc.get_traced_memory()[0] - base) / 2**20
        print(f"   right after 200 calls: {held:.0f} MiB, {default_watchdog().watched()} leases")
        time.sleep(guard_for(payload).options.ttl / 3 + 0.5)
        gc.collect()
        later = (tracemalloc.get_traced_memory()[0] - base) / 2**20
        print(f"   after ttl/3 + 0.5 s:   {later:.0f} MiB, {default_watchdog().watched()} leases")
        tracemalloc.stop()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
