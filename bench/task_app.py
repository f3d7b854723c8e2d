"""The Celery app of the task-throughput benchmark (``bench/task_bench.py``).

``python -m celery -A bench.task_app worker ...`` builds it from the
environment, and the benchmark process imports the same module (with the same
environment) to publish, so task names and settings agree on both sides:

``BENCH_TASK_BROKER``
    Redis URL of the benchmark's private broker, also the result backend.
``BENCH_TASK_LOCK_URL``
    Redis URL of the private lock store shared by every contender:
    ``redlock_url`` of ``SingletonTask``, ``ONCE['settings']['url']`` of
    celery-once and ``singleton_backend_url`` of celery-singleton.

Tasks, one per contender, each returning its argument:

``bench.plain``
    A plain ``@app.task``.
``bench.redlock``
    ``base=celery_redlock.SingletonTask`` (locks in the worker, around the body).
``bench.once``
    ``base=celery_once.QueueOnce`` (locks at publish, unlocks after the run).
``bench.singleton``
    ``base=celery_singleton.Singleton`` (locks at publish, unlocks on success/failure).

``bench.floor``
    A plain task whose body makes two library-free round trips to the lock
    store (a pre-packed ``SET NX PX`` and the ``EVALSHA`` of a compare-and-delete,
    on a raw socket per thread, replies parsed by hiredis): the least any lock
    taken and released in the worker with two commands can cost, so the
    benchmark can tell the lock library's own cost from the round trips'.
``bench.floor_scripts``
    The same raw socket sending celery-redlock's own acquire and release
    scripts: the lock store's work of ``SingletonTask`` without its client.

``bench.bare_lock`` and ``bench.redispy_lock``
    A plain task whose body takes and releases a lock of its own on the lock
    store: celery-redlock's bare ``Lock`` (fence drawn, no watchdog, no guard)
    and redis-py's ``Lock``. ``bench/task_instructions.py`` counts them: what a
    lock client costs a task without anything of ``SingletonTask`` around it.

plus ``bench.hold``, the ``SingletonTask`` of the duplicate storm: it holds its
lock until the benchmark sets a stop key on the *broker* Redis, so its waiting
adds nothing to the lock store's command counts.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Celery
from celery_once import QueueOnce  # type: ignore[import-untyped]
from celery_singleton import Singleton  # type: ignore[import-untyped]

from celery_redlock import Lock as CoreLock
from celery_redlock import SingletonTask
from celery_redlock.core.scripts import ACQUIRE, RELEASE

__all__ = [
    "HOLD_TTL",
    "app",
    "bare_lock",
    "floor",
    "floor_scripts",
    "hold",
    "once",
    "plain",
    "redispy_lock",
    "redlock",
    "singleton",
    "stop_key",
]

#: Lock TTL of ``bench.hold``: long enough that no watchdog renewal (at a third
#: of it) happens during a storm, so the storm's counts hold acquires only.
HOLD_TTL = 120.0
#: Interval at which ``bench.hold`` checks its stop key.
HOLD_POLL_SECONDS = 0.01

BROKER_URL = os.environ.get("BENCH_TASK_BROKER", "redis://127.0.0.1:1/0")
LOCK_URL = os.environ.get("BENCH_TASK_LOCK_URL", "redis://127.0.0.1:1/0")

app = Celery("task_bench", set_as_current=True)
app.conf.update(
    broker_url=BROKER_URL,
    result_backend=BROKER_URL,
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # celery-redlock
    redlock_url=LOCK_URL,
    # celery-singleton
    singleton_backend_url=LOCK_URL,
)
# celery-once reads its (upper-case) ONCE setting.
app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": LOCK_URL, "default_timeout": 60},
}

_broker_client: redis.Redis | None = None

#: The floor's release: delete the key only if it holds the token.
FLOOR_RELEASE_LUA = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)
FLOOR_TTL_MS = b"60000"
#: The fence counter of ``bench.floor_scripts`` (one per store, as the library keeps it).
FLOOR_FENCE_KEY = b"task_bench:floor:fence"


class _RawLockStore(threading.local):
    """A thread's raw socket to the lock store, for ``bench.floor``: no library in the way."""

    def __init__(self) -> None:
        import hiredis

        parts = urlsplit(LOCK_URL)
        self.sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()
        self.pack = hiredis.pack_command
        self.sha = self.call(self.pack((b"SCRIPT", b"LOAD", FLOOR_RELEASE_LUA)))
        self.acquire_sha = self.call(self.pack((b"SCRIPT", b"LOAD", ACQUIRE.source)))
        self.release_sha = self.call(self.pack((b"SCRIPT", b"LOAD", RELEASE.source)))
        self.prefix = f"task_bench:floor:{os.getpid()}:{threading.get_ident()}:".encode()

    def call(self, packed: bytes) -> Any:
        """Write one packed command and return its reply."""
        self.sock.sendall(packed)
        reply = self.reader.gets()
        while reply is False:
            self.reader.feed(self.sock.recv(65536))
            reply = self.reader.gets()
        return reply


_raw_lock_store: _RawLockStore | None = None


def stop_key(tag: str) -> str:
    """Return the broker-Redis key whose existence ends ``bench.hold(tag, ...)``."""
    return f"task_bench:stop:{tag}"


@app.task(name="bench.plain")  # type: ignore[untyped-decorator]
def plain(i: int) -> int:
    """Return ``i``: the baseline, no lock."""
    return i


@app.task(name="bench.redlock", base=SingletonTask)  # type: ignore[untyped-decorator]
def redlock(i: int) -> int:
    """Return ``i`` under celery-redlock's lock."""
    return i


@app.task(name="bench.once", base=QueueOnce, once={"graceful": True})  # type: ignore[untyped-decorator]
def once(i: int) -> int:
    """Return ``i`` under celery-once's publish-time lock."""
    return i


@app.task(name="bench.singleton", base=Singleton)  # type: ignore[untyped-decorator]
def singleton(i: int) -> int:
    """Return ``i`` under celery-singleton's publish-time lock."""
    return i


@app.task(name="bench.floor")  # type: ignore[untyped-decorator]
def floor(i: int) -> int:
    """Return ``i`` between a raw ``SET NX PX`` and a raw compare-and-delete on the lock store."""
    global _raw_lock_store
    if _raw_lock_store is None:
        _raw_lock_store = _RawLockStore()
    store = _raw_lock_store
    key = store.prefix + str(i).encode()
    token = key  # unique per call, which is all a token must be here
    if store.call(store.pack((b"SET", key, token, b"NX", b"PX", FLOOR_TTL_MS))) != b"OK":
        raise RuntimeError(f"the floor's uncontended SET NX failed for {key!r}")
    result = i
    store.call(store.pack((b"EVALSHA", store.sha, b"1", key, token)))
    return result


@app.task(name="bench.floor_scripts")  # type: ignore[untyped-decorator]
def floor_scripts(i: int) -> int:
    """Return ``i`` between celery-redlock's own two scripts, sent on the floor's raw socket.

    The same server-side work as ``SingletonTask`` (the acquire that draws a
    fence, the compare-and-delete release), none of its client-side work.
    """
    global _raw_lock_store
    if _raw_lock_store is None:
        _raw_lock_store = _RawLockStore()
    store = _raw_lock_store
    key = store.prefix + str(i).encode()
    token = key
    acquire = (b"EVALSHA", store.acquire_sha, b"2", key, FLOOR_FENCE_KEY, token)
    if not isinstance(store.call(store.pack((*acquire, FLOOR_TTL_MS, b"3600000", b"0"))), int):
        raise RuntimeError(f"the script floor's uncontended acquire failed for {key!r}")
    result = i
    store.call(store.pack((b"EVALSHA", store.release_sha, b"1", key, token, b"0")))
    return result


_lock_store_client: redis.Redis | None = None


def _lock_store() -> redis.Redis:
    global _lock_store_client
    if _lock_store_client is None:
        _lock_store_client = redis.Redis.from_url(LOCK_URL)
    return _lock_store_client


def _inside(lock: Any, i: int) -> int:
    """Return ``i`` between an uncontended ``lock.acquire`` and ``lock.release``."""
    if not lock.acquire(blocking=False):
        raise RuntimeError(f"the uncontended acquire of {lock!r} failed")
    try:
        return i
    finally:
        lock.release()


@app.task(name="bench.bare_lock")  # type: ignore[untyped-decorator]
def bare_lock(i: int) -> int:
    """Return ``i`` inside celery-redlock's bare ``Lock`` (no watchdog, no guard around it)."""
    return _inside(CoreLock(_lock_store(), f"task_bench:bare:{i}", timeout=60), i)


@app.task(name="bench.redispy_lock")  # type: ignore[untyped-decorator]
def redispy_lock(i: int) -> int:
    """Return ``i`` inside redis-py's own ``Lock``."""
    return _inside(_lock_store().lock(f"task_bench:redispy:{i}", timeout=60), i)


@app.task(name="bench.hold", base=SingletonTask, lock_ttl=HOLD_TTL)  # type: ignore[untyped-decorator]
def hold(tag: str, max_seconds: float) -> float:
    """Hold the lock of ``(tag, max_seconds)`` until the stop key appears; return the wait."""
    global _broker_client
    if _broker_client is None:
        _broker_client = redis.Redis.from_url(BROKER_URL)
    started = time.monotonic()
    key = stop_key(tag)
    while time.monotonic() - started < max_seconds:
        if _broker_client.exists(key):
            break
        time.sleep(HOLD_POLL_SECONDS)
    return time.monotonic() - started
