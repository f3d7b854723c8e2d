"""One acquisition of a lock: its token, fence, validity deadline and ``lost`` flag.

A :class:`Lease` outlives the call that took it: the watchdog renews it, and
its holder reads ``fence`` and ``lost`` from it. Every lock class of the
package (sync, asyncio, Redlock) hands out leases.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .replication import Replication

from redis.crc import key_slot

from .lua import Script
from .scripts import RENEW

__all__ = ["DEFAULT_DRIFT_FACTOR", "DRIFT_FLOOR", "Clock", "Lease", "LostCallback"]

logger = logging.getLogger(__name__)

#: A monotonic clock: seconds, as a float.
Clock = Callable[[], float]
#: What a lock calls, with the lease, when the lease is found lost.
LostCallback = Callable[["Lease"], object]

#: Share of the TTL assumed lost to clock drift between client and server.
DEFAULT_DRIFT_FACTOR = 0.01
#: Fixed part of the drift allowance, in seconds (Redlock's 2 ms).
DRIFT_FLOOR = 0.002


class Lease:
    """One acquisition of a lock: what the holder has and how long it is valid.

    A lease outlives the acquiring call: the watchdog renews it, and the holder
    (or a Celery task through ``current_lock()``) reads ``fence`` and ``lost``
    from it. It is safe to read from any thread.

    Attributes:
        name: The lock's Redis key.
        token: The value stored under ``name`` while this lease holds it.
        fence: The fencing token of this acquisition, or ``None`` without fencing.
        ttl: The lock's time to live in seconds, or ``None`` if it never expires.
        renewals: How many times the watchdog has renewed the lease.
        replication: How many replicas must confirm its renewals, or ``None``.
        lost: ``True`` once the lease is known not to hold the lock any more.
        loss_reason: Why the lease was lost, when it was.
        released: ``True`` once the holder started releasing it.
        reap_margin: Seconds before the end of its TTL at which the lease
            counts as lost (see :meth:`leave_to_reaper`); 0 unless a reaper
            may judge it.
    """

    #: Whether the watchdog renews this lease by calling :meth:`renew` instead of
    #: batching it with the other leases of its connection pool. Leases that span
    #: several servers (Redlock) set it.
    renews_itself: ClassVar[bool] = False
    #: The script the watchdog renews leases of this class with, in batches:
    #: KEYS are their :attr:`renew_key`, ARGV as for
    #: :data:`~celery_redlock.core.scripts.RENEW` (which a lock's lease uses).
    renew_script: ClassVar[Script] = RENEW

    __slots__ = (
        "__weakref__",
        "_clock",
        "_drift_factor",
        "_lost",
        "_owner",
        "_renew_resp",
        "client",
        "deadline",
        "fence",
        "label",
        "loss_reason",
        "name",
        "on_lost",
        "reap_margin",
        "released",
        "renewals",
        "replication",
        "token",
        "ttl",
    )

    def __init__(
        self,
        *,
        client: Any,
        name: str,
        token: bytes,
        fence: int | None,
        ttl: float | None,
        sent_at: float,
        clock: Clock,
        drift_factor: float = DEFAULT_DRIFT_FACTOR,
        on_lost: LostCallback | None = None,
        owner: object | None = None,
        label: str | None = None,
        replication: Replication | None = None,
    ) -> None:
        self.client = client
        self.label = label
        self.replication = replication
        self.name = name
        self.token = token
        self.fence = fence
        self.ttl = ttl
        self.on_lost = on_lost
        self.renewals = 0
        self._lost = False
        self.loss_reason: str | None = None
        self.released = False
        self._clock = clock
        self._drift_factor = drift_factor
        self._owner = weakref.ref(owner) if owner is not None else None
        self._renew_resp: tuple[int, bytes, bytes, int] | None = None
        self.reap_margin = 0.0
        # deadline_for, inline: one lease is built per task.
        self.deadline: float | None = (
            None if ttl is None else sent_at + ttl - (ttl * drift_factor + DRIFT_FLOOR)
        )

    def validate_until(self, sent_at: float, ttl: float) -> None:
        """Record that the server granted ``ttl`` seconds to a request sent at ``sent_at``.

        Validity is measured from when the request was *sent*, minus the drift
        allowance, so it never overstates what the server granted.
        """
        self.deadline = self.deadline_for(sent_at, ttl)

    def deadline_for(self, sent_at: float, ttl: float) -> float:
        """Return the validity deadline of ``ttl`` seconds granted to a request sent then."""
        return sent_at + ttl - self.reap_margin - (ttl * self._drift_factor + DRIFT_FLOOR)

    def leave_to_reaper(self, margin: float) -> None:
        """Count the lock valid only until ``margin`` seconds of its TTL are left, from now on.

        A reaper may release a lock whose holder it judges dead before its TTL
        has run out (see :mod:`celery_redlock.celery.reaper`). A holder that
        only looks dead (cut off from the store while it runs) must count its
        lock lost before then, so this lease's deadline, and every deadline a
        renewal sets, comes ``margin`` seconds before the TTL's end.
        """
        self.reap_margin = margin
        if self.deadline is not None:
            self.deadline -= margin

    def renew_resp(self) -> tuple[bytes, bytes]:
        """This lease's part of a batched renewal, encoded as the server reads it (RESP).

        The key (one of the script's KEYS), then the token and the TTL in
        milliseconds (its two ARGV). Built once: a watchdog renewing thousands
        of leases a period would otherwise encode the same bytes every time.
        """
        cached = self._renew_parts()
        return cached[1], cached[2]

    def renew_slot(self) -> int:
        """The Redis Cluster hash slot of :attr:`renew_key` (computed once)."""
        return self._renew_parts()[3]

    def _renew_parts(self) -> tuple[int, bytes, bytes, int]:
        assert self.ttl is not None
        ms = int(self.ttl * 1000)
        cached = self._renew_resp
        if cached is None or cached[0] != ms:
            encode = self.client.get_encoder().encode
            key, token, text = encode(self.renew_key), encode(self.token), b"%d" % ms
            cached = self._renew_resp = (
                ms,
                b"$%d\r\n%s\r\n" % (len(key), key),
                b"$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(token), token, len(text), text),
                key_slot(key),
            )
        return cached

    @property
    def renew_key(self) -> str:
        """The key :attr:`renew_script` renews this lease at: the lock's own key."""
        return self.name

    def renew(self) -> None:
        """Renew the lease to its full TTL on its own (only when :attr:`renews_itself`).

        Raises:
            NotImplementedError: Always here: single-server leases are renewed in
                batches by the watchdog.
        """
        raise NotImplementedError(f"{type(self).__name__} is renewed in batches by the watchdog")

    @property
    def lost(self) -> bool:
        """``True`` once the lease may no longer hold the lock.

        That is as soon as it is known lost (the watchdog or a release found
        another value), and also, for a lease not released, as soon as its
        validity deadline has passed: a holder that slept past it (SIGSTOP, a
        long GC or VM pause) finds out on its first look, not only once the
        watchdog's next pass marks it.
        """
        if self._lost:
            return True
        if self.released or self.deadline is None:
            return False
        return self._clock() >= self.deadline

    @lost.setter
    def lost(self, value: bool) -> None:
        self._lost = value

    @property
    def known_lost(self) -> bool:
        """``True`` once the lease was found lost (:meth:`mark_lost`, a release), not just expired.

        What the watchdog goes by: a lease past its deadline but not yet marked
        is still handed to :meth:`still_to_renew`, which marks it, logs it and
        calls ``on_lost``.
        """
        return self._lost

    def remaining(self) -> float:
        """Seconds of validity left: ``inf`` without a TTL, ``0.0`` once lost or released."""
        if self._lost or self.released:
            return 0.0
        if self.deadline is None:
            return float("inf")
        return max(0.0, self.deadline - self._clock())

    @property
    def valid(self) -> bool:
        """``True`` while the lease is neither lost, released nor past its deadline."""
        return self.remaining() > 0.0

    @property
    def abandoned(self) -> bool:
        """``True`` when the lock that took the lease was garbage-collected."""
        return self._owner is not None and self._owner() is None

    def still_to_renew(self) -> bool:
        """Whether a renewer should renew this lease now; says why not in the log.

        ``False`` for a lease released or lost, for one whose lock object was
        garbage-collected (it is left to expire, with a warning), and for one
        past its validity, which is marked lost: the process slept past it
        (SIGSTOP, a long GC pause), so someone else may hold the lock by now
        and renewing is not safe.
        """
        if self.released or self._lost:
            return False
        if self.abandoned:
            logger.warning(
                "%s was garbage-collected while held; letting it expire", self.describe()
            )
            return False
        if self.remaining() <= 0.0:
            self.mark_lost("validity expired before it could be renewed")
            return False
        return True

    def mark_lost(self, reason: str) -> None:
        """Flag the lease as lost, log it once, and call its ``on_lost`` callback.

        Called by the watchdog and by operations that find the lock not owned.
        The callback's exceptions are logged, never propagated: it runs on the
        watchdog thread, which must survive it.
        """
        if self._lost or self.released:
            return
        self._lost = True
        self.loss_reason = reason
        logger.error("%s lost: %s", self.describe(), reason)
        # Read once: a release on another thread may clear it meanwhile.
        on_lost = self.on_lost
        if on_lost is not None:
            try:
                on_lost(self)
            except Exception:
                logger.exception("on_lost callback of %s failed", self.describe())

    def describe(self) -> str:
        """Name the lock, its holder and fence, for log lines."""
        holder = f" held by {self.label}" if self.label else ""
        return f"lock {self.name}{holder} (fence {self.fence})"

    def __repr__(self) -> str:
        state = "lost" if self._lost else "released" if self.released else "held"
        return f"<Lease {self.name!r} fence={self.fence} {state}>"
