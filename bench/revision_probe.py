"""One measurement of one revision of celery_redlock, run by ``bench/revisions.py``.

The driver runs this file in a subprocess whose ``PYTHONPATH`` points at the
tree under test, so it must import only what every compared revision has: the
public names ``Lock`` and ``SingletonTask`` of the package. Usage::

    python bench/revision_probe.py {lock,task} --redis-url URL [--calls N] [--warmup N] [--blocks N]

Measures, after ``--warmup`` untimed calls and ``gc.freeze()``:

``lock``
    ``Lock(client, key, timeout=10)``: acquire + release of one key, ``--calls`` cycles.
``task``
    One uncontended ``SingletonTask`` call (distinct argument each call) run by
    Celery's own tracer in-process, as a pool process runs it
    (``setup_worker_optimizations`` applied, ``build_tracer``); no result
    backend, so what is measured is the task's lock plus Celery's tracing.
    ``lock_ttl`` is an hour (see ``TASK_LOCK_TTL_SECONDS``).

Prints one JSON object: the package's ``__file__`` (the driver checks that the
intended tree was imported), the calls, and wall and CPU seconds of each of
``--blocks`` timed blocks of ``--calls`` calls.
With ``--opcodes`` it instead counts the bytecode instructions the measured
calls execute, per Python function and in every thread (``sys.settrace`` and
``threading.settrace`` with opcode events, installed before the warm-up): a
deterministic, Python-level view of where a revision spends its work.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

LOCK_TTL_SECONDS = 10
# The task's lock TTL. A released lease stays in the renewal watchdog's heap
# until it is due (a third of the TTL) and the watchdog thread then drops it:
# work done on a timer, not per call. Under callgrind a run lasts minutes, so
# with the default 10 s TTL some of those drops would fall inside the counted
# calls, more or fewer with the machine's speed. An hour keeps them all out.
TASK_LOCK_TTL_SECONDS = 3600.0
LOCK_KEY = "revision-probe:lock"
TASK_NAME = "revision_probe.singleton"


def lock_cycle(redis_url: str) -> Callable[[], None]:
    """Return one acquire + release of a ``celery_redlock.Lock`` on a fixed key."""
    import redis

    from celery_redlock import Lock

    client = redis.Redis.from_url(redis_url)
    lock = Lock(client, LOCK_KEY, timeout=LOCK_TTL_SECONDS)

    def cycle() -> None:
        if not lock.acquire():
            raise RuntimeError("an uncontended acquire failed")
        lock.release()

    return cycle


def task_call(redis_url: str) -> Callable[[], object]:
    """Return one traced, uncontended ``SingletonTask`` call with a fresh argument."""
    from celery import Celery
    from celery.app import trace

    from celery_redlock import SingletonTask

    app = Celery("revision_probe", set_as_current=True)
    app.conf.update(
        broker_url="memory://",
        result_backend=None,  # disabled: storing a result is no part of the lock's cost
        redlock_url=redis_url,
    )

    @app.task(  # type: ignore[untyped-decorator]
        name=TASK_NAME, base=SingletonTask, lock_ttl=TASK_LOCK_TTL_SECONDS
    )
    def singleton(i: int) -> int:
        return i

    # What a pool process does before its first task: finalize the app and
    # patch Task.__call__ so that SingletonTask's super().__call__ runs the body.
    trace.setup_worker_optimizations(app, hostname="revision-probe")
    tracer = trace.build_tracer(TASK_NAME, app.tasks[TASK_NAME], app=app, eager=False)
    counter = iter(range(10**12))

    def call() -> object:
        task_id = str(uuid.uuid4())
        args = (next(counter),)
        request = {"id": task_id, "hostname": "revision-probe", "args": args, "kwargs": {}}
        traced = tracer(task_id, args, {}, request)
        if traced.info is not None or traced.retval != args[0]:  # info is set on failure
            raise RuntimeError(f"the traced task did not succeed: {traced!r}")
        return traced

    return call


MEASURES: dict[str, Callable[[str], Callable[[], object]]] = {
    "lock": lock_cycle,
    "task": task_call,
}


def timed(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """Wall and CPU seconds of ``calls`` calls of ``fn``.

    ``time.process_time`` is called exactly once before and once after the
    calls, and nothing else in the probed code calls it: under callgrind the
    driver zeroes and dumps the counters on entry to its C function, so one
    dump holds exactly the measured calls.
    """
    wall = time.perf_counter()
    cpu = time.process_time()
    for _ in range(calls):
        fn()
    wall_s = time.perf_counter() - wall
    return {"wall_s": wall_s, "cpu_s": time.process_time() - cpu}


class OpcodeCounter:
    """Counts bytecodes executed and entries per code object, in every thread.

    Installed before the measured callable is built, so that threads it starts
    (the renewal watchdog) are traced as well; counts only inside ``counting()``.
    Each thread counts into its own counters, so no increment is lost.
    """

    def __init__(self) -> None:
        self.active = False
        self.generated: dict[Any, str] = {}
        self.per_thread: dict[int, tuple[collections.Counter[Any], collections.Counter[Any]]] = {}

    def _counters(self) -> tuple[collections.Counter[Any], collections.Counter[Any]]:
        ident = threading.get_ident()
        if ident not in self.per_thread:
            self.per_thread[ident] = (collections.Counter(), collections.Counter())
        return self.per_thread[ident]

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode" and self.active:
            self._counters()[0][frame.f_code] += 1
        return self._local

    def _call(self, frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if self.active:
            code = frame.f_code
            self._counters()[1][code] += 1
            if code.co_filename.startswith("<") and code not in self.generated:
                # Code made at run time (a dataclass's __init__) is named by
                # the class of its ``self``: its qualname alone says nothing.
                owner = frame.f_locals.get("self")
                if owner is not None:
                    self.generated[code] = f"{type(owner).__qualname__}.{code.co_name}"
        return self._local

    def install(self) -> None:
        threading.settrace(self._call)
        sys.settrace(self._call)

    def count(self, fn: Callable[[], object], calls: int) -> dict[str, Any]:
        """Run ``calls`` calls counted; return counts per ``file:line:qualname`` and thread."""
        self.per_thread.clear()
        self.active = True
        try:
            for _ in range(calls):
                fn()
        finally:
            self.active = False
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]
        main = threading.get_ident()
        merged: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        threads = {"main": 0, "other": 0}
        for ident, (ops, entered) in self.per_thread.items():
            threads["main" if ident == main else "other"] += sum(ops.values())
            for code in set(ops) | set(entered):
                qualname = self.generated.get(code) or getattr(code, "co_qualname", code.co_name)
                where = merged[f"{code.co_filename}:{code.co_firstlineno}:{qualname}"]
                where[0] += ops[code]
                where[1] += entered[code]
        return {"opcodes": dict(merged), "thread_ops": threads}


def main(argv: list[str] | None = None) -> int:
    """Measure one thing once and print the result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("measure", choices=sorted(MEASURES))
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=1, help="timed blocks of --calls calls")
    parser.add_argument("--opcodes", action="store_true", help="count bytecodes instead of timing")
    args = parser.parse_args(argv)

    import celery_redlock

    counter = OpcodeCounter()
    if args.opcodes:
        counter.install()
    fn = MEASURES[args.measure](args.redis_url)
    for _ in range(args.warmup):
        fn()
    # The two trees import different modules (the flat package loads Celery
    # even for the lock), so their heaps differ in size. Frozen, that heap is
    # out of the cyclic collector's way: its passes then walk only what the
    # measured calls leave behind, instead of a full pass over the start-up
    # heap landing inside one tree's counted calls and not the other's.
    gc.collect()
    gc.freeze()
    result: dict[str, Any] = {
        "measure": args.measure,
        "package_file": celery_redlock.__file__,
        "calls": args.calls,
        "warmup": args.warmup,
    }
    if args.opcodes:
        result.update(counter.count(fn, args.calls))
    else:
        result["blocks"] = [timed(fn, args.calls) for _ in range(args.blocks)]
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
