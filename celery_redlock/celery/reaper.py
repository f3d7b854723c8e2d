"""The continuous reaper: a running worker frees locks and permits of provably dead holders.

Stale-lock recovery (:mod:`celery_redlock.core.recovery`) runs once, when a worker
starts again under the same node name. The reaper runs in every worker's
main process, every ``redlock_reaper_interval`` seconds, and releases a task
lock, or one permit of a semaphore (``lock_limit`` above 1), only on one of
two kinds of proof, the same for both:

* **pid gone**: the value names this very worker (node name *and* host) and a
  process that no longer exists here. That is a pool process killed while it
  held the lock (``SIGKILL``, the OOM killer); the worker goes on running and
  would otherwise leave the lock to its TTL. Only this worker's own holders
  are judged by pid: a worker of another node on the same host name may run
  in another pid namespace (a container sharing the host's network and name),
  where a pid missing here proves nothing. That worker's own reaper judges it.
* **worker silent**: the holder's worker has not answered a ping for
  ``redlock_reaper_unresponsive_after`` seconds *and* the lock's (or the
  permit's own) TTL shows that its renewals stopped: more than half of it is
  gone since the last renewal, while the watchdog renews every third (its
  worker is then pinged), and at most half of it less the silence limit is
  left (it is then released: see :func:`holder_margin` for why, and why a
  TTL of at most twice the silence limit is left to expire). A worker that
  is merely busy (a solo pool running a long task cannot answer a ping)
  still renews, so its locks and permits never meet the second condition.

Anything else is left to its TTL: a holder on another host that answers, or
whose renewals go on; a value without the holder's host, pid or TTL (format
``v1``, enqueue reservations, locks taken outside a worker). Each release is
a compare-and-delete of the exact value (or permit) read, which for the second
kind also checks again that the TTL is still past the renewal deadline, so a
holder that renewed meanwhile keeps its lock; a permit released or granted
again meanwhile stays, and so do the semaphore's other permits (see
:mod:`celery_redlock.core.reclaim`). Every release is logged at WARNING with
its evidence and counted (``celery_redlock_reaped_total``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from celery_redlock.calls.options import OPTIONS
from celery_redlock.core.holder import Holder
from celery_redlock.core.inventory import LockInfo, PermitInfo, clients_of, find_locks
from celery_redlock.core.reclaim import delete_permit, reap_lock
from celery_redlock.core.recovery import lock_prefixes, pid_alive
from celery_redlock.core.store import LockStore

__all__ = [
    "DEFAULT_UNRESPONSIVE_AFTER",
    "OVERDUE_SHARE",
    "REASONS",
    "Reaped",
    "Reaper",
    "SilenceTracker",
    "Verdict",
    "app_holder_margin",
    "holder_margin",
    "judge",
    "renewal_overdue",
]

logger = logging.getLogger(__name__)

#: A lock or permit was reaped because its holder, a process of this worker, is gone.
PID_GONE = "pid_gone"
#: A lock or permit was reaped because its holder's worker fell silent and stopped renewing it.
WORKER_SILENT = "worker_silent"
#: Why a lock can be reaped, as the metrics count it.
REASONS = (PID_GONE, WORKER_SILENT)

#: Share of the TTL that may be left at most for the renewals to count as stopped.
#: The watchdog renews every third of the TTL (a little earlier when it batches),
#: so a live holder's lock keeps at least two thirds; half leaves a sixth of slack.
OVERDUE_SHARE = 0.5
#: Seconds a ping waits for the holders' workers to answer.
PING_TIMEOUT = 1.0
#: Seconds of silence after which a worker counts as dead, unless
#: ``redlock_reaper_unresponsive_after`` says otherwise.
DEFAULT_UNRESPONSIVE_AFTER = 60.0


def holder_margin(ttl: float, unresponsive_after: float) -> float:
    """Seconds before the end of its TTL at which a task's lock must count as lost to its holder.

    The worker-silent rule releases a lock only once at most
    ``ttl * OVERDUE_SHARE - unresponsive_after`` seconds of its TTL are left
    (checked again on the server as it deletes), so no sooner than half the
    TTL plus the silence limit after its last renewal, and never when the TTL
    is at most twice the silence limit (120 s with the defaults): such locks
    expire on their own first. A holder that only looks dead (cut off from the
    store and its broker while its task runs) still counts its lock valid
    until its TTL has run out. It must count it lost before that release: the
    lease keeps this margin (``Lease.leave_to_reaper``).
    """
    return max(0.0, ttl * OVERDUE_SHARE - unresponsive_after)


def app_holder_margin(conf: Mapping[str, Any], ttl: float) -> float:
    """:func:`holder_margin` under the app's ``redlock_reaper_unresponsive_after``.

    Kept with ``redlock_reaper = False`` too: other workers' reapers judge
    this process's locks by their own settings.

    Raises:
        ConfigurationError: Naming ``redlock_reaper_unresponsive_after`` if it
            holds a bad value.
    """
    silence = conf.get("redlock_reaper_unresponsive_after")
    if silence is None:
        return holder_margin(ttl, DEFAULT_UNRESPONSIVE_AFTER)
    return holder_margin(ttl, OPTIONS["ttl"].validate("redlock_reaper_unresponsive_after", silence))


@dataclass(frozen=True)
class Verdict:
    """Why a lock or permit may be released.

    Attributes:
        reason: One of :data:`REASONS`.
        evidence: One sentence naming what was checked.
        max_pttl_ms: The most time (ms) the lock or permit may have left when
            deleted (-1: any).
    """

    reason: str
    evidence: str
    max_pttl_ms: int = -1


def renewal_overdue(info: LockInfo | PermitInfo) -> bool:
    """``True`` if ``info``'s TTL shows its renewals stopped (see :data:`OVERDUE_SHARE`).

    For a permit that is the permit's own TTL, whatever the semaphore's other
    permits have left.
    """
    holder = info.holder
    if holder is None or not holder.ttl_ms or info.ttl is None:
        return False
    return info.ttl * 1000 < holder.ttl_ms * OVERDUE_SHARE


def judge(
    info: LockInfo | PermitInfo,
    *,
    node: str,
    host: str,
    silent_for: Callable[[str], float | None],
    unresponsive_after: float,
    alive: Callable[[int], bool] = pid_alive,
) -> Verdict | None:
    """Decide whether ``info``'s holder is provably dead; ``None`` keeps the lock or permit.

    Args:
        info: The lock, or one permit of a semaphore, as read.
        node: The judging worker's node name.
        host: The judging worker's host name.
        silent_for: Seconds a worker node has failed to answer pings (``None``:
            it answered the latest one, or was never asked).
        unresponsive_after: Seconds of silence that count as dead.
        alive: Tells whether a pid on this host is alive.
    """
    holder = info.holder
    if isinstance(info, LockInfo) and info.kind != "lock":
        return None  # a reservation names its publisher; a semaphore, its permits
    if holder is None or holder.host is None or not holder.ttl_ms:
        return None
    if holder.hostname == node:
        if holder.host == host and not alive(holder.pid):
            return Verdict(
                PID_GONE,
                f"holder pid {holder.pid} of this worker ({node}) on host {host} is gone",
            )
        return None
    # No sooner than the silence limit after the renewals were seen to stop:
    # the holder's lease has ended by then (see holder_margin).
    most_left_ms = int(holder_margin(holder.ttl_ms / 1000, unresponsive_after) * 1000)
    if info.ttl is None or not most_left_ms or info.ttl * 1000 > most_left_ms:
        return None
    silence = silent_for(holder.hostname)
    if silence is None or silence < unresponsive_after:
        return None
    ttl = holder.ttl_ms / 1000
    what = "permit" if isinstance(info, PermitInfo) else "lock"
    return Verdict(
        WORKER_SILENT,
        f"worker {holder.hostname} (host {holder.host}) has not answered a ping for "
        f"{silence:.1f}s (limit {unresponsive_after:g}s) and the {what} was last renewed "
        f"{ttl - info.ttl:.1f}s ago ({info.ttl:.1f}s of its {ttl:g}s TTL left; renewed "
        f"every {ttl / 3:.1f}s while its holder runs)",
        most_left_ms,
    )


class SilenceTracker:
    """Remembers since when each worker node has failed to answer pings.

    Args:
        clock: Monotonic clock in seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: dict[str, float] = {}

    def heard(self, asked: Iterable[str], answered: Iterable[str]) -> None:
        """Record a ping of ``asked`` nodes, of which ``answered`` replied."""
        now = self._clock()
        replied = set(answered)
        for node in asked:
            if node in replied:
                self._since.pop(node, None)
            else:
                self._since.setdefault(node, now)
        for node in replied:
            self._since.pop(node, None)

    def silent_for(self, node: str) -> float | None:
        """Seconds since ``node`` first failed to answer, ``None`` if it did answer."""
        since = self._since.get(node)
        return None if since is None else self._clock() - since

    def forget_except(self, nodes: Iterable[str]) -> None:
        """Drop every node but ``nodes`` (those no lock names any more)."""
        keep = set(nodes)
        for node in list(self._since):
            if node not in keep:
                del self._since[node]


@dataclass(frozen=True)
class Reaped:
    """A lock, or one permit of a semaphore, that the reaper released.

    Attributes:
        info: The lock or semaphore as read.
        verdict: The proof its holder was dead.
        permit: The permit released, ``None`` for a lock.
    """

    info: LockInfo
    verdict: Verdict
    permit: PermitInfo | None = None

    @property
    def holder(self) -> Holder | None:
        """The dead holder: of the permit, or of the lock."""
        return self.permit.holder if self.permit is not None else self.info.holder

    def describe(self) -> str:
        """``lock KEY`` or ``permit SLOT of semaphore KEY``, as the log names it."""
        if self.permit is None:
            return f"lock {self.info.key}"
        return f"permit {self.permit.slot} of semaphore {self.info.key}"


def _ping(app: Any, nodes: Sequence[str], timeout: float) -> set[str]:
    replies = app.control.ping(destination=list(nodes), timeout=timeout) or ()
    return {node for reply in replies for node in reply}


class Reaper:
    """Scans the lock store from a daemon thread and releases the locks and permits of dead holders.

    Args:
        app: The worker's app.
        node: The worker's node name.
        interval: Seconds between passes.
        unresponsive_after: Seconds a worker must stay silent (see :func:`judge`).
        store: The lock store to scan; the reaper's own client, not shared
            with pool processes (a fork while it is in use must not hand them
            a pool in mid-operation).
        on_reaped: Called with the reason of each lock or permit released.
        on_pass: Called after each pass that read the store.
        ping: ``(app, nodes, timeout) -> nodes that answered``.
        clock: Monotonic clock in seconds, for the silences.
    """

    def __init__(
        self,
        app: Any,
        node: str,
        *,
        interval: float,
        unresponsive_after: float,
        store: LockStore,
        on_reaped: Callable[[str], None] = lambda reason: None,
        on_pass: Callable[[], None] = lambda: None,
        ping: Callable[[Any, Sequence[str], float], set[str]] = _ping,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.node = node
        self.host = socket.gethostname()
        self.interval = interval
        self.unresponsive_after = unresponsive_after
        self.store = store
        self.silence = SilenceTracker(clock)
        self._on_reaped = on_reaped
        self._on_pass = on_pass
        self._ping = ping
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Monotonic time of the latest finished pass, ``None`` before the first.
        self.last_pass: float | None = None

    def start(self) -> None:
        """Start the thread; the first pass runs one interval from now."""
        self._thread = threading.Thread(target=self._loop, name="celery-redlock-reaper")
        self._thread.daemon = True
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, waiting up to ``timeout`` seconds for a pass to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.store.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.run_once()
            except Exception as exc:  # the thread must outlive a bad pass
                logger.warning("celery-redlock: reaper pass failed: %r", exc)

    def run_once(self) -> list[Reaped]:
        """Make one pass; return the locks and permits released with their verdicts.

        Raises:
            redis.exceptions.RedisError: When the lock store fails.
        """
        clients = clients_of(self.store)
        locks: dict[str, LockInfo] = {}
        for client in clients:
            try:
                found = list(find_locks(client, lock_prefixes(self.app), semaphores=True))
            except RedisError as exc:
                if len(clients) == 1:
                    raise
                # One Redlock master down: the others' locks are still judged
                # (each delete checks that master's own copy).
                logger.warning("celery-redlock: reaper could not read a master (%r)", exc)
                continue
            for info in found:
                locks.setdefault(info.key, info)
        # A lock is judged whole; a semaphore permit by permit, each on its own holder.
        held = [(info, permit) for info in locks.values() for permit in info.permits or (None,)]
        self._ask_silent([permit or info for info, permit in held])
        released = []
        for info, permit in held:
            verdict = judge(
                permit or info,
                node=self.node,
                host=self.host,
                silent_for=self.silence.silent_for,
                unresponsive_after=self.unresponsive_after,
            )
            if verdict is None:
                continue
            reaped = Reaped(info, verdict, permit)
            if self._release(clients, reaped):
                released.append(reaped)
        self.last_pass = time.monotonic()
        self._on_pass()
        return released

    def _ask_silent(self, held: Iterable[LockInfo | PermitInfo]) -> None:
        # Only the workers of locks and permits whose renewals stopped are
        # pinged: a healthy store costs no ping at all. Nor are those of a TTL
        # the rule cannot apply to (at most twice the silence limit).
        nodes = sorted(
            {
                info.holder.hostname
                for info in held
                if info.holder is not None
                and info.holder.hostname != self.node
                and holder_margin((info.holder.ttl_ms or 0) / 1000, self.unresponsive_after) > 0
                and renewal_overdue(info)
            }
        )
        self.silence.forget_except(nodes)
        if nodes:
            self.silence.heard(nodes, self._ping(self.app, nodes, PING_TIMEOUT))

    def _release(self, clients: Sequence[Any], reaped: Reaped) -> bool:
        info, verdict, permit = reaped.info, reaped.verdict, reaped.permit
        deleted = 0
        for client in clients:
            try:
                if permit is None:
                    deleted += reap_lock(client, info, verdict.max_pttl_ms)
                else:
                    deleted += delete_permit(client, info, permit, verdict.max_pttl_ms)
            except RedisError as exc:
                if len(clients) == 1:
                    raise
                # Logged and counted below if another master's copy went.
                logger.warning("celery-redlock: reaper could not release on a master (%r)", exc)
        if not deleted:
            return False
        holder = reaped.holder
        assert holder is not None
        logger.warning(
            "celery-redlock: reaper released %s of task %s[%s] (fence %s): %s",
            reaped.describe(),
            info.task,
            holder.task_id,
            info.fence if permit is None else permit.fence,
            verdict.evidence,
        )
        self._on_reaped(verdict.reason)
        return True
