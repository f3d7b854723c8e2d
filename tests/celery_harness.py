"""Real Celery workers, brokers and an execution history for the worker-level tests.

:class:`CeleryWorker` runs ``celery worker`` as a subprocess of the test run
and stops it (and only it, by pid) afterwards. :class:`Broker` names the two
brokers the tests are parametrised over. Tasks write one JSON record per
execution with :func:`record_execution`, and :class:`History` reads them
back and checks the properties the lock promises: no two executions of one
key overlap, fences of one key increase.

Everything lives in Redis db 9 of the shared server under a per-test key
prefix, and on RabbitMQ's default vhost under per-test queue and exchange
names, so concurrent runs never see each other's state;
:func:`delete_prefixed_keys` and :meth:`Broker.cleanup` remove exactly what
one test created.

This module imports neither pytest nor the project's tests, so worker
processes can import it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import redis

__all__ = [
    "AMQP_URL",
    "BROKERS",
    "REDIS_URL",
    "Broker",
    "CeleryWorker",
    "Execution",
    "History",
    "HistoryRecorder",
    "UnlockedLease",
    "WorkerError",
    "delete_prefixed_keys",
    "history_key",
    "record_execution",
    "running_key",
    "start_all",
    "task_states",
    "wait_for_gate",
    "wait_until",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Broker, result backend and lock store of the Redis-backed tests: db 9, never flushed.
REDIS_URL = "redis://127.0.0.1:6379/9"
#: RabbitMQ's default vhost; tests isolate themselves by queue and exchange names.
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
POOLS = ("prefork", "solo", "threads")

_LOG_TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
T = TypeVar("T")


class WorkerError(RuntimeError):
    """A test worker could not be started, or a broker is not reachable."""


class UnlockedLease:
    """Stands in for the lease of a run that holds no lock, so its execution is recorded too."""

    fence = 0

    def __init__(self, name: str) -> None:
        self.name = name


def wait_for_gate(client: redis.Redis, gate: str | None, timeout: float) -> bool:
    """Wait (in a test task) until key ``gate`` exists; ``False`` if ``timeout`` passed first.

    Tests open a gate to let a holding task finish exactly when they choose.
    """
    if gate is None:
        return True
    deadline = time.monotonic() + timeout
    while not client.exists(gate):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    *,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition",
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Raises:
        TimeoutError: After ``timeout`` seconds, with ``message`` (called if callable).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise TimeoutError(f"timed out after {timeout}s waiting for {text}")
        time.sleep(interval)


# -- processes -----------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat: tells a process from a later one reusing its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; it ends at the last ")".
    return stat.rsplit(")", 1)[1].split()[19]


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found.extend(int(child) for child in path.read_text().split())
    return found


def _descendants(pid: int) -> list[int]:
    result: list[int] = []
    todo = _children(pid)
    while todo:
        child = todo.pop()
        if child not in result:
            result.append(child)
            todo.extend(_children(child))
    return result


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class CeleryWorker:
    """A ``celery worker`` subprocess consuming ``queues`` of the app at ``app_module``.

    Args:
        app_module: What ``celery -A`` gets, e.g. ``"tests.celery_apps.storm"``.
        pool: ``"prefork"``, ``"solo"`` or ``"threads"``.
        concurrency: ``-c``.
        queues: ``-Q``.
        nodename: ``-n``; unique per test, so remote control and logs tell workers apart.
        log_dir: Directory of the worker's log file (stdout and stderr together).
        env: Environment overrides on top of ``os.environ``.
        extra_args: Appended to the command line.
        ping_app: If given, ``start()`` also accepts a ``control.ping`` answer as readiness.
    """

    def __init__(
        self,
        app_module: str,
        *,
        pool: str,
        concurrency: int,
        queues: Sequence[str],
        nodename: str,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        ping_app: Any = None,
    ) -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, not {pool!r}")
        if not queues:
            raise ValueError("a worker needs at least one queue")
        self.app_module = app_module
        self.pool = pool
        self.concurrency = concurrency
        self.queues = list(queues)
        self.nodename = nodename
        self.log_path = Path(log_dir) / f"{nodename.replace('@', '_')}.log"
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.ping_app = ping_app
        self._proc: subprocess.Popen[bytes] | None = None
        # (pid, start time) of every pool process seen, for cleanup after the parent dies.
        self._known_children: dict[int, str] = {}

    @property
    def command(self) -> list[str]:
        """The worker's command line."""
        return [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app_module,
            "worker",
            "-P",
            self.pool,
            "-c",
            str(self.concurrency),
            "-Q",
            ",".join(self.queues),
            "-n",
            self.nodename,
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            "-l",
            "INFO",
            *self.extra_args,
        ]

    @property
    def pid(self) -> int | None:
        """The main process's pid once spawned."""
        return self._proc.pid if self._proc is not None else None

    def spawn(self) -> None:
        """Start the process without waiting for it to be ready."""
        if self._proc is not None:
            raise WorkerError(f"worker {self.nodename} was already started")
        env = dict(os.environ)
        env.update(self.env)
        paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["PYTHONUNBUFFERED"] = "1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # A test process killed by a timeout or Ctrl+C leaves no worker behind.
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def wait_ready(self, timeout: float = 30) -> None:
        """Wait until the worker consumes.

        Raises:
            WorkerError: If it exits or is not ready within ``timeout`` seconds;
                the message carries the log's tail.
        """
        if self._proc is None:
            raise WorkerError(f"worker {self.nodename} was never started")
        deadline = time.monotonic() + timeout
        next_ping = time.monotonic() + 1.0
        marker = f"{self.nodename} ready."
        while True:
            if marker in self.log():
                self._remember_children()
                return
            code = self._proc.poll()
            if code is not None:
                raise WorkerError(
                    f"worker {self.nodename} exited with {code} before it was ready\n"
                    f"{self.log_tail()}"
                )
            if self.ping_app is not None and time.monotonic() >= next_ping:
                next_ping = time.monotonic() + 1.0
                if self._pinged():
                    self._remember_children()
                    return
            if time.monotonic() >= deadline:
                self.stop()
                raise WorkerError(
                    f"worker {self.nodename} not ready after {timeout}s\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def start(self, timeout: float = 30) -> CeleryWorker:
        """Spawn the worker and wait until it is ready; return ``self``.

        Raises:
            WorkerError: As :meth:`wait_ready`.
        """
        self.spawn()
        self.wait_ready(timeout)
        return self

    def _pinged(self) -> bool:
        try:
            replies = self.ping_app.control.ping(destination=[self.nodename], timeout=0.5)
        except Exception:
            return False
        return any(self.nodename in reply for reply in replies or ())

    def child_pids(self) -> list[int]:
        """Pids of the worker's live descendant processes (the prefork pool), from /proc."""
        if self._proc is None or self._proc.poll() is not None:
            return []
        return _descendants(self._proc.pid)

    def _remember_children(self) -> None:
        for pid in self.child_pids():
            start = _start_time(pid)
            if start is not None:
                self._known_children.setdefault(pid, start)

    def _kill_leftover_children(self) -> None:
        for pid, start in self._known_children.items():
            # Only if the pid still names the process we saw, not a newcomer.
            if _start_time(pid) == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._known_children.clear()

    def kill(self) -> None:
        """SIGKILL the main process (pool children are killed by :meth:`stop`)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._remember_children()
        self._proc.kill()
        self._proc.wait()

    def request_stop(self) -> None:
        """Send SIGTERM (warm shutdown) without waiting; :meth:`stop` then waits.

        Lets a test stop several workers at once instead of one after another.
        """
        if self._proc is None or self._proc.poll() is not None:
            return
        self._remember_children()
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15) -> int | None:
        """Warm shutdown (SIGTERM); SIGKILL after ``timeout`` seconds; then kill leftovers.

        Returns the exit code, or ``None`` if the worker never started.
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self.request_stop()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._remember_children()
                proc.kill()
                proc.wait()
        self._kill_leftover_children()
        return proc.returncode

    @property
    def running(self) -> bool:
        """``True`` while the main process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def log(self) -> str:
        """The worker's output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log, labelled with the log's path."""
        tail = "\n".join(self.log().splitlines()[-lines:])
        return f"--- last {lines} lines of {self.log_path} ---\n{tail}"

    def __enter__(self) -> CeleryWorker:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<CeleryWorker {self.nodename} -P {self.pool} -c {self.concurrency} pid={self.pid}>"


def start_all(workers: Sequence[CeleryWorker], timeout: float = 30) -> None:
    """Spawn ``workers`` together, then wait for each: start-up overlaps.

    Raises:
        WorkerError: If one fails; the others that started are left to the caller.
    """
    for worker in workers:
        worker.spawn()
    for worker in workers:
        worker.wait_ready(timeout)


def task_states(app: Any, task_ids: Sequence[str]) -> dict[str, tuple[str, Any]]:
    """``{task id: (state, result or meta)}`` read in one MGET from a Redis result backend.

    ``PENDING`` stands for "nothing stored yet", as in ``AsyncResult.state``.
    """
    backend = app.backend
    values = backend.mget([backend.get_key_for_task(task_id) for task_id in task_ids])
    states: dict[str, tuple[str, Any]] = {}
    for task_id, value in zip(task_ids, values):
        if value is None:
            states[task_id] = ("PENDING", None)
        else:
            meta = backend.decode_result(value)
            states[task_id] = (meta["status"], meta["result"])
    return states


# -- brokers -------------------------------------------------------------------


@dataclass(frozen=True)
class Broker:
    """A broker the worker tests run against.

    Attributes:
        name: ``"redis"`` or ``"amqp"`` (the pytest parameter id).
        url: Its URL; tasks, results and locks of one test stay in its key prefix
            (Redis) or under its queue and exchange names (RabbitMQ).
    """

    name: str
    url: str

    def check(self, timeout: float = 3.0) -> None:
        """Connect once.

        Raises:
            WorkerError: Naming the broker and the error when it cannot be reached.
        """
        from kombu import Connection

        try:
            with Connection(self.url, connect_timeout=timeout) as conn:
                conn.ensure_connection(max_retries=1, timeout=timeout)
        except Exception as exc:
            raise WorkerError(
                f"{self.name} broker at {self.url} is not reachable ({exc!r}). The worker "
                "tests need it: CI starts RabbitMQ and Redis; start them locally."
            ) from exc

    def cleanup(self, queues: Sequence[str], exchanges: Sequence[str]) -> None:
        """Delete the test's queues and exchanges from RabbitMQ.

        On Redis everything, bindings included, is under the test's key prefix
        and goes with :func:`delete_prefixed_keys`.
        """
        if self.name != "amqp":
            return
        from kombu import Connection

        with Connection(self.url, connect_timeout=3) as conn:
            channel = conn.default_channel
            for queue in queues:
                channel.queue_delete(queue)
            for exchange in exchanges:
                channel.exchange_delete(exchange)


BROKERS = {
    "redis": Broker("redis", REDIS_URL),
    "amqp": Broker("amqp", AMQP_URL),
}


def delete_prefixed_keys(client: redis.Redis, prefix: str) -> int:
    """SCAN and DEL every key starting with ``prefix``; return how many were deleted.

    ``prefix`` must hold no glob characters; the tests' prefixes are hex.
    """
    if any(char in prefix for char in "*?[]\\"):
        raise ValueError(f"prefix {prefix!r} holds glob characters")
    deleted = 0
    batch: list[Any] = []
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.delete(*batch)
            batch.clear()
    if batch:
        deleted += client.delete(*batch)
    return deleted


# -- execution history -----------------------------------------------------------


def history_key(prefix: str) -> str:
    """The Redis list that tasks append their execution records to."""
    return f"{prefix}:history"


def running_key(prefix: str, lock_key: str) -> str:
    """The counter of executions of ``lock_key`` running right now."""
    return f"{prefix}:running:{lock_key}"


class HistoryRecorder:
    """What a running task adds to its execution record (see :func:`record_execution`)."""

    def __init__(self) -> None:
        self.extra: dict[str, Any] = {}


@contextlib.contextmanager
def record_execution(
    client: redis.Redis,
    prefix: str,
    *,
    task_id: str,
    name: str,
    lease: Any,
    hostname: str | None,
) -> Iterator[HistoryRecorder]:
    """Record one execution of a task holding ``lease`` around the ``with`` body.

    The counter is incremented before the start time is taken and decremented
    after the end time, so a counter value of 1 at every start proves the
    same thing as non-overlapping intervals, measured by Redis instead of
    by clocks.
    """
    key = lease.name
    counter = running_key(prefix, key)
    holders = int(client.incr(counter))
    start = time.time()
    recorder = HistoryRecorder()
    try:
        yield recorder
    finally:
        end = time.time()
        client.decr(counter)
        record = {
            "task_id": task_id,
            "name": name,
            "key": key,
            "fence": lease.fence,
            "pid": os.getpid(),
            "thread": threading.current_thread().name,
            "hostname": hostname,
            "start": start,
            "end": end,
            "holders": holders,
            **recorder.extra,
        }
        client.rpush(history_key(prefix), json.dumps(record))


@dataclass(frozen=True)
class Execution:
    """One execution record.

    Attributes:
        task_id: The task's id.
        name: The task's name.
        key: The lock key it held (``current_lock().name``).
        fence: The fence of that hold.
        pid: The executing process.
        thread: The executing thread's name.
        hostname: The worker node name.
        start: Wall-clock start, taken after the counter increment.
        end: Wall-clock end, taken before the counter decrement.
        holders: The counter's value after this execution's increment (1 = alone).
        extra: Whatever the task added.
    """

    task_id: str
    name: str
    key: str
    fence: int
    pid: int
    thread: str
    hostname: str | None
    start: float
    end: float
    holders: int
    extra: Mapping[str, Any]

    @classmethod
    def from_json(cls, text: str | bytes) -> Execution:
        """Parse a record written by :func:`record_execution`."""
        data = json.loads(text)
        fields = {name: data.pop(name) for name in cls.__dataclass_fields__ if name != "extra"}
        return cls(**fields, extra=data)

    def overlaps(self, other: Execution) -> bool:
        """``True`` if the two intervals share any instant."""
        return self.start < other.end and other.start < self.end


class History:
    """Reads and checks the execution records of one test.

    Args:
        client: A client on the Redis holding the records.
        prefix: The test's key prefix.
    """

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def executions(self) -> list[Execution]:
        """Every record so far, in the order they were written."""
        raw = self.client.lrange(history_key(self.prefix), 0, -1)
        return [Execution.from_json(item) for item in raw]

    def by_key(self) -> dict[str, list[Execution]]:
        """Records grouped by lock key, each group ordered by start time."""
        groups: dict[str, list[Execution]] = defaultdict(list)
        for execution in self.executions():
            groups[execution.key].append(execution)
        return {key: sorted(group, key=lambda e: e.start) for key, group in groups.items()}

    def running(self, lock_key: str) -> int:
        """How many executions of ``lock_key`` are running now, per the counter."""
        return int(self.client.get(running_key(self.prefix, lock_key)) or 0)

    def assert_no_overlap_per_key(self) -> None:
        """Fail unless executions of each key ran one at a time, by clock and by counter."""
        for key, group in self.by_key().items():
            crowded = [e.task_id for e in group if e.holders != 1]
            assert not crowded, f"{key}: executions that did not run alone: {crowded}"
            for before, after in zip(group, group[1:]):
                assert before.end <= after.start, (
                    f"{key}: {before.task_id} [{before.start:.6f}, {before.end:.6f}] overlaps "
                    f"{after.task_id} [{after.start:.6f}, {after.end:.6f}]"
                )
            assert self.running(key) == 0, f"{key}: counter left at {self.running(key)}"

    def assert_fences_increase_per_key(self) -> None:
        """Fail unless, per key, each later execution has a strictly larger fence."""
        for key, group in self.by_key().items():
            fences = [e.fence for e in group]
            assert all(isinstance(f, int) for f in fences), f"{key}: fences {fences}"
            for before, after in zip(group, group[1:]):
                assert before.fence < after.fence, (
                    f"{key}: fence {after.fence} of {after.task_id} is not above "
                    f"{before.fence} of {before.task_id}, which ran before it"
                )

    def assert_at_most_per_key(self, limit: int) -> None:
        """Fail unless, per key, at most ``limit`` executions ran at once, by counter and clock.

        The counter is Redis's count of executions inside when each started;
        the clock check sweeps the recorded intervals (an end and a start at
        the same instant do not overlap).
        """
        for key, group in self.by_key().items():
            crowded = [(e.task_id, e.holders) for e in group if e.holders > limit]
            assert not crowded, f"{key}: executions that found more than {limit} inside: {crowded}"
            events = sorted([(e.start, 1) for e in group] + [(e.end, -1) for e in group])
            inside = most = 0
            for _, step in events:
                inside += step
                most = max(most, inside)
            assert most <= limit, f"{key}: {most} executions overlapped, limit {limit}"
            assert self.running(key) == 0, f"{key}: counter left at {self.running(key)}"

    def assert_fences_rise_per_slot(self) -> None:
        """Fail unless, per key, fences are distinct and, per permit slot (``extra["slot"]``),
        strictly increase in start order.

        A slot has one holder at a time, as a lock does. Across slots no order
        is promised: fences are drawn when a permit is taken, and a holder may
        start its body later than one that took a permit after it.
        """
        for key, group in self.by_key().items():
            fences = [e.fence for e in group]
            assert len(set(fences)) == len(fences), f"{key}: a fence was handed out twice"
            slots: dict[Any, list[Execution]] = defaultdict(list)
            for execution in group:
                slots[execution.extra.get("slot")].append(execution)
            for slot, held in slots.items():
                for before, after in zip(held, held[1:]):
                    assert before.end <= after.start and before.fence < after.fence, (
                        f"{key} slot {slot}: {after.task_id} (fence {after.fence}) followed "
                        f"{before.task_id} (fence {before.fence}) out of order or overlapping"
                    )

    def overlapping_pairs(self) -> list[tuple[Execution, Execution]]:
        """Pairs of executions of *different* keys whose intervals overlap."""
        ordered = sorted(self.executions(), key=lambda e: e.start)
        pairs = []
        for i, first in enumerate(ordered):
            for second in ordered[i + 1 :]:
                if second.start >= first.end:
                    break
                if second.key != first.key:
                    pairs.append((first, second))
        return pairs
