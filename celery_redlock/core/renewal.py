"""The renewal watchdog: one thread per process keeps every auto-renewed lease alive.

Leases wait in a heap ordered by when they are next due, a third of their TTL
after their last renewal. A pass renews every lease that is due or more than
half way there, so leases fall into step and each pass costs one pipelined
round trip per Redis connection pool, however many locks (and semaphore
permits, renewed by a script of their own in the same pipeline) the process holds.
On Redis Cluster a script may touch one hash slot only: a pass sends one script
call per slot (and script), all in one write per master (see
:mod:`celery_redlock.core.renewal_wire`, which sends a pass).

A renewal that fails on a connection error is retried until the lease's own
validity deadline; only then is the lease given up as lost. A lease the server
no longer holds for us is lost at once. Leases that need their replicas'
acknowledgement (``min_replicas``) are batched apart, with ``WAIT`` in the same
round trip; a pass that too few replicas acknowledged does not count, and is
retried like one that failed. Either way the holder learns it through
``Lease.lost`` and its ``on_lost`` callback, and an ERROR line names the key
and fence. The thread catches everything, so it never dies silently.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from .error_text import describe_error
from .fences import is_cluster
from .lease import Clock, Lease
from .lua import Script
from .nodes import bounded_client
from .renewal_wire import send_chunks
from .replication import Replication

__all__ = ["Watchdog", "default_watchdog"]

logger = logging.getLogger(__name__)

#: Most locks renewed by one script call; a pass pipelines as many calls as needed.
BATCH_SIZE = 1000
#: Longest a renewal round trip may take, in seconds. A hung server must not
#: hold the watchdog past the validity of every lease it renews.
RENEWAL_TIMEOUT = 1.0


def _renewal_client(client: Any, replication: Replication | None = None) -> Any:
    """Return a client for renewals: same server and options, bounded timeouts.

    Its own small pool also keeps renewals going when the application has used
    up its pool's connections. Pools this module does not know how to clone
    (Sentinel, Cluster) are used as they are. No client-side retries: one
    attempt per pass, the watchdog retries itself within each lease's validity.
    A renewal that waits for replicas may take that much longer.
    """
    timeout = RENEWAL_TIMEOUT + (replication.timeout if replication is not None else 0.0)
    return bounded_client(client, timeout, max_connections=4)


def _retry_delay(lease: Lease) -> float:
    # Several attempts fit inside the third of a TTL that is left, without
    # hammering a server that is down.
    assert lease.ttl is not None
    return min(1.0, max(0.05, lease.ttl / 10))


class Watchdog:
    """Renews auto-renewed leases from a daemon thread started on first use.

    Args:
        clock: Monotonic clock in seconds; must be the clock of the watched leases.
        batch_size: Most leases per script call.
    """

    def __init__(self, *, clock: Clock = time.monotonic, batch_size: int = BATCH_SIZE) -> None:
        self._clock = clock
        self._batch_size = batch_size
        self._reset()
        # A forked child must not renew its parent's locks, and it has no
        # thread: start afresh. A weak reference lets the watchdog be collected.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reset_if_alive(ref))

    def _reset(self) -> None:
        # The condition's own lock, taken directly where every task passes
        # (watch): a C-level with block instead of Condition's Python one.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, Lease]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        # Set by the thread as it ends: cheaper to read on every watch() than
        # Thread.is_alive(), which takes the thread's state lock.
        self._thread_ended = False
        # Keyed by the application's pool, then by the replication its leases
        # need (it lengthens the timeout); only the watchdog thread touches it.
        self._clients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def watch(self, lease: Lease) -> None:
        """Renew ``lease`` until it is released or lost.

        Raises:
            ValueError: If the lease has no TTL.
            RuntimeError: If the renewal thread cannot be started (a thread
                limit); the lease is then not watched, and the next call
                tries to start the thread again.
        """
        if lease.ttl is None:
            raise ValueError(f"lock {lease.name} has no TTL to renew")
        with self._lock:
            entry = (self._clock() + lease.ttl / 3, next(self._seq), lease)
            heapq.heappush(self._heap, entry)
            if self._thread is None or self._thread_ended:
                thread = threading.Thread(
                    target=self._run, name="celery-redlock-watchdog", daemon=True
                )
                # Before start(): a thread that dies at once sets it again.
                self._thread_ended = False
                try:
                    thread.start()
                except BaseException:
                    # After a failed start (a thread limit reached) the next
                    # watch() tries again, instead of leaving every later
                    # lease to a thread that never ran. This lease was not
                    # taken on: its acquire fails.
                    self._thread = None
                    self._heap.remove(entry)
                    heapq.heapify(self._heap)
                    raise
                self._thread = thread
            elif self._heap[0][2] is lease:
                # Only a lease due before everything else changes when the
                # thread must wake; waking it for every task costs a context
                # switch per task on a busy worker.
                self._cond.notify()

    def watched(self) -> int:
        """How many leases the heap holds (released ones linger until they are due)."""
        with self._cond:
            return len(self._heap)

    def _push(self, lease: Lease, due: float) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), lease))

    def _run(self) -> None:
        try:
            while True:
                try:
                    self.renew_due()
                except Exception:  # pragma: no cover - the loop must outlive any bug
                    logger.exception("renewal pass failed; the watchdog carries on")
                with self._cond:
                    wait = self._heap[0][0] - self._clock() if self._heap else None
                    if wait is None or wait > 0:
                        self._cond.wait(wait)
        finally:  # pragma: no cover - only something like a fatal signal ends it
            self._thread_ended = True

    def renew_due(self) -> None:
        """Run one renewal pass over the leases that are due now.

        The watchdog thread calls this; tests call it directly with a fake clock.
        """
        now = self._clock()
        batch = self._take_due(now)
        by_pool: dict[tuple[Any, Replication | None], list[Lease]] = defaultdict(list)
        alone: list[Lease] = []
        # Thousands of leases share a few clients: find each client's group once.
        pools: dict[int, Any] = {}
        for lease in batch:
            if not lease.still_to_renew():
                continue
            if lease.renews_itself:
                alone.append(lease)
                continue
            client = lease.client
            pool = pools.get(id(client))
            if pool is None:
                # A Cluster client has no pool: its leases are one group, split
                # by slot when sent. Any other client without a pool renews alone.
                pool = pools[id(client)] = _group_of(client)
            by_pool[lease if pool is _ALONE else pool, lease.replication].append(lease)
        for (pool, replication), leases in by_pool.items():
            try:
                clients = self._clients.get(pool)
                if clients is None:
                    clients = self._clients[pool] = {}
                client = clients.get(replication)
                if client is None:
                    client = clients[replication] = _renewal_client(leases[0].client, replication)
            except Exception as exc:
                self._schedule_retry(leases, exc)
                continue
            self._renew_group(client, leases, replication)
        # After the batches: a lease spanning several servers waits for a
        # majority, up to its node timeout, which must not delay the others.
        for lease in alone:
            self._renew_alone(lease)

    def _renew_alone(self, lease: Lease) -> None:
        sent_at = self._clock()
        try:
            lease.renew()
        except Exception as exc:
            # A lease found not owned is already marked lost; anything else is
            # retried until its validity runs out, as for a failed batch.
            if not (lease.known_lost or lease.released):
                self._schedule_retry([lease], exc)
            return
        if lease.released:
            return
        lease.renewals += 1
        assert lease.ttl is not None
        with self._cond:
            self._push(lease, sent_at + lease.ttl / 3)

    def _take_due(self, now: float) -> list[Lease]:
        # Renew early rather than alone: whatever is half way to due joins this
        # pass, which keeps every lease in one round trip.
        taken: list[Lease] = []
        with self._cond:
            heap = self._heap
            if not heap or heap[0][0] > now + heap[0][2].ttl / 6:  # type: ignore[operator]
                return taken
            if len(heap) <= _SCAN_FROM:
                while heap:
                    due, _, lease = heap[0]
                    if due > now + lease.ttl / 6:  # type: ignore[operator]
                        break
                    heapq.heappop(heap)
                    taken.append(lease)
                return taken
            # Many leases, and usually most of them due at once (they fall into
            # step): one scan and a rebuild cost less than a pop per lease.
            kept = []
            for entry in heap:
                if entry[2].released:
                    continue  # most leases of a busy worker: dropped here, not renewed
                if entry[0] > now + entry[2].ttl / 6:  # type: ignore[operator]
                    kept.append(entry)
                else:
                    taken.append(entry[2])
            heapq.heapify(kept)
            self._heap = kept
        return taken

    def _renew_group(
        self, client: Any, leases: Sequence[Lease], replication: Replication | None = None
    ) -> None:
        # Locks and semaphore permits renew with different scripts: one chunk
        # list per script (and per hash slot on Cluster, where a script touches
        # one slot), all of them in the pass's one pipelined round trip.
        by_script: dict[tuple[Script, int], list[Lease]] = {}
        if is_cluster(client):
            for lease in leases:
                by_script.setdefault((lease.renew_script, lease.renew_slot()), []).append(lease)
        else:
            for lease in leases:
                by_script.setdefault((lease.renew_script, 0), []).append(lease)
        size = self._batch_size
        chunks = [
            (script, group[i : i + size])
            for (script, _), group in by_script.items()
            for i in range(0, len(group), size)
        ]
        sent_at = self._clock()
        try:
            replies = send_chunks(client, chunks, replication)
        except Exception as exc:
            # Whatever went wrong, the leases go back in the heap: dropping them
            # would leave them neither renewed nor reported lost.
            self._schedule_retry(leases, exc)
            return
        renewed: list[tuple[float, int, Lease]] = []
        seq = self._seq
        for (_, chunk), reply in zip(chunks, replies):
            for lease, pttl_ms in zip(chunk, reply):
                if lease.released:
                    continue
                if not pttl_ms:
                    lease.mark_lost("the key no longer holds this lease's token")
                    continue
                lease.validate_until(sent_at, pttl_ms / 1000)
                lease.renewals += 1
                renewed.append((sent_at + lease.ttl / 3, next(seq), lease))  # type: ignore[operator]
        # Back in the heap under one acquisition of the lock, not one per lease;
        # many at once are appended and the heap rebuilt (linear, in C).
        with self._cond:
            heap = self._heap
            if len(renewed) > len(heap):
                heap += renewed
                heapq.heapify(heap)
            else:
                for entry in renewed:
                    heapq.heappush(heap, entry)

    def _schedule_retry(self, leases: Iterable[Lease], exc: BaseException) -> None:
        now = self._clock()
        retrying = 0
        for lease in leases:
            if lease.remaining() <= 0.0:
                lease.mark_lost(
                    f"could not be renewed before its validity ran out: {describe_error(exc)}"
                )
                continue
            retrying += 1
            with self._cond:
                self._push(lease, now + min(_retry_delay(lease), lease.remaining() / 2))
        if retrying:
            logger.warning(
                "renewal of %d lock(s) failed (%s); retrying until their validity runs out",
                retrying,
                describe_error(exc),
            )


#: Heaps longer than this are scanned for due leases rather than popped one by one.
_SCAN_FROM = 64


#: The group of a client whose leases renew one by one.
_ALONE = object()


def _group_of(client: Any) -> Any:
    """What a client's leases are batched by: its pool, a Cluster client itself, or none."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return pool
    return client if is_cluster(client) else _ALONE


def _reset_if_alive(ref: weakref.ref[Watchdog]) -> None:
    watchdog = ref()
    if watchdog is not None:
        watchdog._reset()


_default: Watchdog | None = None
_default_guard = threading.Lock()


def default_watchdog() -> Watchdog:
    """Return the process-wide watchdog, creating it on first use."""
    global _default
    if _default is None:
        with _default_guard:
            if _default is None:
                _default = Watchdog()
    return _default
