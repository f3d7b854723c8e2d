"""The renewal watchdog: one thread per process keeps every auto-renewed lease alive.

Leases wait in a heap ordered by when they are next due, a third of their TTL
after their last renewal. A pass renews every lease that is due or more than
half way there, so leases fall into step and each pass costs one pipelined
round trip per Redis connection pool, however many locks (and semaphore
permits, renewed by a script of their own in the same pipeline) the process holds.
On Redis Cluster a script may touch one hash slot only: a pass sends one script
call per slot (and script), all in one cluster pipeline, which redis-py writes
to every node before reading: one round trip per node.

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

from redis.crc import key_slot
from redis.exceptions import NoScriptError

from . import replication as replicated
from .error_text import describe_error
from .fences import is_cluster
from .lease import Clock, Lease
from .lua import Script
from .nodes import bounded_client
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
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Lease]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        # Keyed by the application's pool, then by the replication its leases
        # need (it lengthens the timeout); only the watchdog thread touches it.
        self._clients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def watch(self, lease: Lease) -> None:
        """Renew ``lease`` until it is released or lost."""
        if lease.ttl is None:
            raise ValueError(f"lock {lease.name} has no TTL to renew")
        with self._cond:
            self._push(lease, self._clock() + lease.ttl / 3)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery-redlock-watchdog", daemon=True
                )
                self._thread.start()
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
        while True:
            try:
                self.renew_due()
            except Exception:  # pragma: no cover - the loop must outlive any bug
                logger.exception("renewal pass failed; the watchdog carries on")
            with self._cond:
                wait = self._heap[0][0] - self._clock() if self._heap else None
                if wait is None or wait > 0:
                    self._cond.wait(wait)

    def renew_due(self) -> None:
        """Run one renewal pass over the leases that are due now.

        The watchdog thread calls this; tests call it directly with a fake clock.
        """
        now = self._clock()
        batch = self._take_due(now)
        by_pool: dict[tuple[Any, Replication | None], list[Lease]] = defaultdict(list)
        alone: list[Lease] = []
        for lease in batch:
            if not lease.still_to_renew():
                continue
            if lease.renews_itself:
                alone.append(lease)
                continue
            # A Cluster client has no pool: its leases are one group, split by
            # slot when sent. Any other client without a pool renews alone.
            client = lease.client
            pool = getattr(client, "connection_pool", None)
            if pool is None and is_cluster(client):
                pool = client
            by_pool[lease if pool is None else pool, lease.replication].append(lease)
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
        taken: list[Lease] = []
        with self._cond:
            heap = self._heap
            while heap:
                due, _, lease = heap[0]
                assert lease.ttl is not None
                # Renew early rather than alone: whatever is half way to due
                # joins this pass, which keeps every lease in one round trip.
                if due > now + lease.ttl / 6:
                    break
                heapq.heappop(heap)
                taken.append(lease)
        return taken

    def _renew_group(
        self, client: Any, leases: Sequence[Lease], replication: Replication | None = None
    ) -> None:
        # Locks and semaphore permits renew with different scripts: one chunk
        # list per script (and per hash slot on Cluster, where a script touches
        # one slot), all of them in the pass's one pipelined round trip.
        by_script: dict[tuple[Script, int], list[Lease]] = {}
        if is_cluster(client):
            encode = client.get_encoder().encode
            for lease in leases:
                slot = key_slot(encode(lease.renew_key))
                by_script.setdefault((lease.renew_script, slot), []).append(lease)
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
            replies = self._send(client, chunks, replication)
        except Exception as exc:
            # Whatever went wrong, the leases go back in the heap: dropping them
            # would leave them neither renewed nor reported lost.
            self._schedule_retry(leases, exc)
            return
        for (_, chunk), reply in zip(chunks, replies):
            for lease, pttl_ms in zip(chunk, reply):
                self._settle(lease, sent_at, pttl_ms)

    def _send(
        self,
        client: Any,
        chunks: Sequence[tuple[Script, Sequence[Lease]]],
        replication: Replication | None = None,
    ) -> list[Any]:
        def script_args(chunk: Sequence[Lease]) -> tuple[list[str], list[Any]]:
            args: list[Any] = ["1"]
            for lease in chunk:
                assert lease.ttl is not None
                args += (lease.token, int(lease.ttl * 1000))
            return [lease.renew_key for lease in chunk], args

        if len(chunks) == 1 or (replication is not None and is_cluster(client)):
            # One call, or a Cluster whose WAIT must follow each slot's call on
            # that slot's node: sent one by one.
            if replication is None:
                return [script(client, *script_args(chunk)) for script, chunk in chunks]
            return [
                replicated.renew(client, *script_args(chunk), replication, script=script)
                for script, chunk in chunks
            ]
        pipe = client.pipeline(transaction=False)
        for script, chunk in chunks:
            _queue(client, pipe, script, *script_args(chunk))
        if replication is not None:
            # Behind every script on the pipeline's one connection: it covers them all.
            pipe.execute_command(*replication.wait)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        acknowledged = replies.pop() if replication is not None else 0
        if replication is None:
            self._resend_unknown_scripts(client, chunks, replies, script_args)
        for i, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):
                # Sent apart, on a connection of its own: with its own WAIT.
                script, chunk = chunks[i]
                args = script_args(chunk)
                if replication is None:
                    replies[i] = script(client, *args)
                else:
                    replies[i] = replicated.renew(client, *args, replication, script=script)
            elif isinstance(reply, Exception):
                raise reply
        if isinstance(acknowledged, Exception):
            raise acknowledged
        if replication is not None:
            renewed = any(any(reply) for reply in replies)
            replicated.check_acknowledged(
                client, int(acknowledged), replication, chunks[0][1][0].name, renewed=renewed
            )
        return replies

    @staticmethod
    def _resend_unknown_scripts(
        client: Any,
        chunks: Sequence[tuple[Script, Sequence[Lease]]],
        replies: list[Any],
        script_args: Any,
    ) -> None:
        """Load the scripts a server did not know and resend those calls in one pipeline.

        After a restart (or on a Cluster node that never ran them) every call of
        the pass answers ``NOSCRIPT``, having done nothing: sending each again
        alone would cost a round trip per call (per slot, on a Cluster).
        """
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if not missing:
            return
        for script in {chunks[i][0] for i in missing}:
            client.script_load(script.source)  # every primary, on a Cluster client
        pipe = client.pipeline(transaction=False)
        for i in missing:
            script, chunk = chunks[i]
            _queue(client, pipe, script, *script_args(chunk))
        for i, reply in zip(missing, pipe.execute(raise_on_error=False)):
            replies[i] = reply

    def _settle(self, lease: Lease, sent_at: float, pttl_ms: int) -> None:
        if lease.released:
            return
        if not pttl_ms:
            lease.mark_lost("the key no longer holds this lease's token")
            return
        lease.validate_until(sent_at, pttl_ms / 1000)
        lease.renewals += 1
        assert lease.ttl is not None
        with self._cond:
            self._push(lease, sent_at + lease.ttl / 3)

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


def _queue(
    client: Any, pipe: Any, script: Script, keys: Sequence[Any], args: Sequence[Any]
) -> None:
    """Queue one renewal call; on a Cluster, addressed to its slot's node.

    A Cluster pipeline asks a server for the keys of each script call it is not
    told the node of (``COMMAND GETKEYS``): a round trip per call.
    """
    if is_cluster(client):
        script.queue(pipe, keys, args, target_nodes=client.get_node_from_key(keys[0]))
    else:
        script.queue(pipe, keys, args)


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
