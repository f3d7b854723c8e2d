"""Steady locking from threads while a topology fails over, and the checks of its grant history.

A :class:`Locker` takes and releases locks on a few keys in a loop, from a lock
store of its own, and records every grant: its key, fence, and the interval in
which the holder believed it held the lock (from the moment ``acquire``
returned to the moment it called ``release``). Refusals and errors are
counted, not recorded: a refused or failed acquisition holds nothing.

:func:`check_grants` then asserts what a lock must promise across a failover:
no two grants of one key overlap, and the fences of one key strictly increase
in grant order, so none repeats.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from celery_redlock import LockError

__all__ = ["Grant", "Locker", "check_grants", "lockers"]


@dataclass(frozen=True)
class Grant:
    """One acquisition, as its holder saw it (``time.monotonic`` of this process)."""

    locker: str
    key: str
    fence: int
    start: float
    end: float


@dataclass
class Locker:
    """A thread that locks ``keys`` in turn until stopped, recording each grant.

    Args:
        name: Names the locker in the grants (``"warm"``, ``"fresh"``).
        store: Builds the lock store, in the thread: a "fresh" locker opens its
            connections only once started.
        keys: The lock keys, used round robin.
        ttl: Each lock's TTL in seconds (no renewal: holds are much shorter).
        hold: Seconds each grant is held.
    """

    name: str
    store: Callable[[], Any]
    keys: Sequence[str]
    ttl: float = 5.0
    hold: float = 0.02
    grants: list[Grant] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Locker:
        """Start the thread; return the locker."""
        self._thread = threading.Thread(target=self._run, name=f"locker-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it (each step is bounded by the store's timeouts)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            assert not self._thread.is_alive(), f"locker {self.name} did not stop"

    def granted_since(self, moment: float) -> int:
        """How many grants started after ``moment`` (``time.monotonic``)."""
        return sum(grant.start > moment for grant in self.grants)

    def _run(self) -> None:
        store = self.store()
        try:
            turn = 0
            while not self._stop.is_set():
                key = self.keys[turn % len(self.keys)]
                turn += 1
                self._attempt(store, key)
                time.sleep(0.005)
        finally:
            store.close()

    def _attempt(self, store: Any, key: str) -> None:
        try:
            lock = store.lock(key, timeout=self.ttl)
            acquired = lock.acquire(blocking=False)
        except (RedisError, LockError) as exc:
            self.outcomes[type(exc).__name__] += 1
            time.sleep(0.02)
            return
        if not acquired:
            self.outcomes["held"] += 1
            return
        start = time.monotonic()
        fence = lock.fence
        time.sleep(self.hold)
        end = time.monotonic()
        self.grants.append(Grant(self.name, key, fence, start, end))
        self.outcomes["granted"] += 1
        try:
            lock.release()
        except (RedisError, LockError) as exc:
            # Not held any more (lost, or the server went away): it expires.
            self.outcomes[f"release {type(exc).__name__}"] += 1


def lockers(*running: Locker) -> list[Grant]:
    """Stop ``running`` lockers; return all their grants."""
    for locker in running:
        locker.stop()
    return [grant for locker in running for grant in locker.grants]


def check_grants(grants: Sequence[Grant]) -> None:
    """Assert no two grants of a key overlap and each key's fences strictly increase."""
    by_key: dict[str, list[Grant]] = defaultdict(list)
    for grant in grants:
        by_key[grant.key].append(grant)
    for key, held in by_key.items():
        held.sort(key=lambda grant: grant.start)
        for before, after in zip(held, held[1:]):
            assert before.end <= after.start, f"two holders of {key} at once: {before} {after}"
            assert before.fence < after.fence, f"fence of {key} did not rise: {before} {after}"
