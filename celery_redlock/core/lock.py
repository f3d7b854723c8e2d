"""A token lock on one Redis server: redis-py's ``Lock`` plus fencing and auto-renewal.

:class:`Lock` accepts redis-py's constructor parameters and methods and behaves
the same wherever both define behaviour, so ``client.lock(name,
lock_class=celery_redlock.Lock)`` is a drop-in. On top of that every
acquisition is a :class:`Lease`: the token, a fencing token drawn in the same
round trip as the ``SET NX PX``, a validity deadline computed from a monotonic
clock, and a ``lost`` flag that the renewal watchdog raises when the lock is
taken away.

Round trips: acquire 1, release 1, extend 1, reacquire 1. With ``min_replicas``
the acquire and renew scripts carry a ``WAIT`` in the same round trip (see
:mod:`celery_redlock.core.replication`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import redis.lock

from . import replication as replicated
from .exceptions import LockError
from .hold import LOCK, PerThreadLock, check_renewable, lock_not_acquired
from .holder import Refusal
from .lease import DEFAULT_DRIFT_FACTOR, Clock, Lease, LostCallback
from .line import attempt_in_line
from .lock_options import DEFAULT_FENCE_RETENTION, Number, fence_key_for, positive_seconds
from .lock_wire import packed_acquire, packed_release
from .queue_scripts import Place
from .scripts import ACQUIRE, RELEASE, RENEW

if TYPE_CHECKING:
    from .renewal import Watchdog

# Lease and fence_key_for live in lease.py and lock_options.py; they stay
# importable from here, where the API reference has always shown them.
__all__ = ["Lease", "Lock", "fence_key_for"]

logger = logging.getLogger(__name__)

_LockT = TypeVar("_LockT", bound="Lock")
_LeaseT = TypeVar("_LeaseT", bound=Lease)


class Lock(PerThreadLock):
    """A distributed lock on one Redis server, compatible with ``redis.lock.Lock``.

    Args:
        redis: A ``redis.Redis`` client (``decode_responses`` either way).
        name: The Redis key of the lock.
        timeout: Time to live in seconds; ``None`` keeps the lock until released.
        sleep: Seconds between attempts while blocking.
        blocking: Whether ``acquire()`` waits for the lock by default.
        blocking_timeout: Longest wait in seconds; ``None`` waits forever.
        thread_local: Keep the token per thread, as redis-py does.
        raise_on_release_error: Whether leaving the ``with`` block raises when
            the lock was lost meanwhile (otherwise it logs a warning).
        auto_renew: Keep the lock alive from the watchdog thread while held.
            Needs a ``timeout``; the watchdog renews at a third of it.
        on_lost: Called with the :class:`Lease` when it is found lost. Runs on
            the watchdog thread; keep it short.
        fencing: Draw a fencing token on each acquisition (same round trip).
        fence_key: Override the fence counter's key (default: the store's
            counter, one per hash slot on Cluster: ``fence_key_for(name)``).
        fence_retention: Seconds the fence counter outlives its latest draw;
            a store unused that long reseeds its fences from the server
            clock, and they still increase.
        drift_factor: Share of the TTL deducted from local validity for clock drift.
        watchdog: The watchdog to renew with (default: the process-wide one).
        label: Who holds the lock, for log lines (e.g. ``"task add[id]"``).
        clock: Monotonic clock in seconds; injectable for tests.
        min_replicas: Replicas that must acknowledge each acquisition and
            renewal (``WAIT``, in the same round trip) before it counts; with
            fewer the acquisition is given back and ``ReplicationError`` raised.
            Fences are then never below the server clock in microseconds, so
            they do not repeat after a failover. 0 (the default) sends no ``WAIT``.
        replica_timeout: Longest wait for those acknowledgements, in seconds
            (default: 0.5, or a tenth of ``timeout`` when that is shorter).

    Raises:
        ConfigurationError: If an argument is out of range, naming it.
    """

    _logger = logger

    def __init__(
        self,
        redis: Any,
        name: str,
        timeout: Number | None = None,
        sleep: Number = 0.1,
        blocking: bool = True,
        blocking_timeout: Number | None = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
        *,
        auto_renew: bool = False,
        on_lost: LostCallback | None = None,
        fencing: bool = True,
        fence_key: str | None = None,
        fence_retention: Number = DEFAULT_FENCE_RETENTION,
        drift_factor: float = DEFAULT_DRIFT_FACTOR,
        watchdog: Watchdog | None = None,
        clock: Clock = time.monotonic,
        label: str | None = None,
        min_replicas: int = 0,
        replica_timeout: Number | None = None,
    ) -> None:
        self._configure(
            redis,
            name,
            timeout=timeout,
            sleep=sleep,
            blocking=blocking,
            blocking_timeout=blocking_timeout,
            thread_local=thread_local,
            raise_on_release_error=raise_on_release_error,
            auto_renew=auto_renew,
            on_lost=on_lost,
            fencing=fencing,
            fence_key=fence_key,
            fence_retention=fence_retention,
            drift_factor=drift_factor,
            clock=clock,
            label=label,
            min_replicas=min_replicas,
            replica_timeout=replica_timeout,
        )
        self._watchdog = watchdog
        self._fresh_state()

    # -- redis-py compatible API ------------------------------------------------

    def __enter__(self: _LockT) -> _LockT:
        if self.acquire():
            return self
        raise self._not_acquired()

    def _not_acquired(self) -> LockError:
        """Build the error a ``with`` block raises when the lock could not be taken."""
        return lock_not_acquired(self.name, self.local.holder)

    def acquire(
        self,
        sleep: Number | None = None,
        blocking: bool | None = None,
        blocking_timeout: Number | None = None,
        token: str | bytes | None = None,
        place: Place | None = None,
    ) -> bool:
        """Take the lock; return ``True`` once held, ``False`` if not (non-blocking or timed out).

        Args:
            sleep: Seconds between attempts (default: the lock's ``sleep``).
            blocking: Wait for the lock (default: the lock's ``blocking``).
            blocking_timeout: Longest wait in seconds (default: the lock's).
            token: Value to store; default 16 random bytes from ``secrets``, hex.
            place: Wait in line (:mod:`~celery_redlock.core.queue_scripts`).

        Raises:
            redis.exceptions.RedisError: If Redis cannot be reached.
            ReplicationError: With ``min_replicas``, when too few replicas
                acknowledged the lock (it was given back) or the server
                refused it as a replica; a ``RedisError`` too.
        """
        if blocking is None:
            blocking = self.blocking
        encoded = secrets.token_hex(16).encode() if token is None else self._encode_token(token)
        local = self.local
        local.place = None
        stop_trying_at = None
        if blocking:  # a single attempt (every task's) needs neither the clock nor the sleep
            clock, pause = waiting_time(self._clock)
            if blocking_timeout is None:
                blocking_timeout = self.blocking_timeout
            if blocking_timeout is not None:
                stop_trying_at = clock() + blocking_timeout
        while True:
            if place is None:
                acquired = self.do_acquire(encoded)
            else:
                acquired = attempt_in_line(self, encoded, place, type(self).do_acquire is _PLAIN)
            if acquired:
                lease = local.lease
                # The value stored may be the token with an attempt number (Redlock).
                local.token = encoded if lease is None else lease.token
                if self.auto_renew and lease is not None:
                    self.watchdog.watch(lease)
                return True
            if not blocking:
                return False
            delay = self._retry_delay(self.sleep if sleep is None else sleep)
            next_try_at = clock() + delay
            if stop_trying_at is not None and next_try_at > stop_trying_at:
                return False
            pause(delay)

    def _retry_delay(self, sleep: Number) -> float:
        """Seconds to wait before the next attempt of a blocking acquire."""
        return float(sleep)

    def do_acquire(self, token: bytes) -> bool:
        """Make one attempt; on success store the new :class:`Lease` for this thread."""
        sent_at = self._clock()
        fence: int | None = None
        if self.fencing or self.replication is not None:
            keys = (self.name, self.fence_key)
            if self.replication is None:
                packed = packed_acquire(self.name, self.fence_key, token, self._acquire_tail)
                reply = ACQUIRE(self.redis, keys, (token, *self._acquire_argv), packed=packed)
            else:
                reply = replicated.acquire(
                    self.redis,
                    keys,
                    (token, self._ttl_ms, self._fence_retention_ms, "0", "1"),
                    self.replication,
                    self.label,
                )
            if isinstance(reply, list):
                holder_ttl_ms, holder = reply
                self.local.holder = (
                    holder.decode("utf-8", "replace") if isinstance(holder, bytes) else holder,
                    holder_ttl_ms / 1000 if holder_ttl_ms >= 0 else None,
                )
                return False
            fence = int(reply) if self.fencing else None
        elif not self.redis.set(self.name, token, nx=True, px=self._ttl_ms or None):
            self.local.holder = None
            return False
        self.local.holder = None
        self.local.lease = self._new_lease(Lease, self.redis, token, fence, sent_at)
        return True

    def _new_lease(
        self, kind: type[_LeaseT], client: Any, token: bytes, fence: int | None, sent_at: float
    ) -> _LeaseT:
        """Build the lease of an acquisition whose request was sent at ``sent_at``."""
        return kind(
            client=client,
            name=self.name,
            token=token,
            fence=fence,
            ttl=self.timeout,
            sent_at=sent_at,
            clock=self._clock,
            drift_factor=self.drift_factor,
            on_lost=self.on_lost,
            owner=self,
            label=self.label,
            replication=self.replication,
        )

    def locked(self) -> bool:
        """Return ``True`` if anyone holds the lock (one ``GET``)."""
        return self.redis.get(self.name) is not None

    def owned(self) -> bool:
        """Return ``True`` if this thread's token is the lock's value (one ``GET``)."""
        token = self.local.token
        if token is None:
            return False
        stored = self.redis.get(self.name)
        if isinstance(stored, str):
            stored = self.redis.get_encoder().encode(stored)
        return bool(stored == token)

    def do_release(self, expected_token: bytes) -> None:
        """Run the compare-and-delete script."""
        packed = packed_release(self.name, expected_token)
        if not RELEASE(self.redis, (self.name,), (expected_token, b"0"), packed=packed):
            raise LOCK.lost_at_release(self.local.lease, self.name)

    def extend(self, additional_time: Number, replace_ttl: bool = False) -> Literal[True]:
        """Add ``additional_time`` seconds to the TTL left, or set the TTL to it.

        Raises:
            LockError: If this thread does not hold the lock, or it has no timeout.
            ConfigurationError: If ``additional_time`` is not positive.
            LockNotOwned: If the lock was lost meanwhile.
        """
        check_renewable(self.name, self.local.token, self.timeout, "extend")
        positive_seconds("additional_time", additional_time, allow_none=False)
        return self.do_extend(additional_time, replace_ttl)

    def do_extend(self, additional_time: Number, replace_ttl: bool) -> Literal[True]:
        """Run the renew script for this lock alone."""
        self._renew(int(additional_time * 1000), replace_ttl, "extend")
        return True

    def reacquire(self) -> Literal[True]:
        """Reset the lock's TTL to ``timeout``.

        Raises:
            LockError: If this thread does not hold the lock, or it has no timeout.
            LockNotOwned: If the lock was lost meanwhile.
        """
        check_renewable(self.name, self.local.token, self.timeout, "reacquire")
        return self.do_reacquire()

    def do_reacquire(self) -> Literal[True]:
        """Run the renew script with the lock's own TTL."""
        self._renew(self._ttl_ms, True, "reacquire")
        return True

    @property
    def lease(self) -> Lease | None:
        """This thread's latest lease: held, lost or released; ``None`` before any."""
        return self.local.lease

    @property
    def refusal(self) -> Refusal:
        """Who held the key when this thread's latest acquire was refused.

        Read it after :meth:`acquire` returned ``False``; after a successful
        acquire it says nothing (both fields ``None``).
        """
        refusal = Refusal.of(self.local.holder)
        place = self.local.place
        if place is None:
            return refusal
        rank, queued, arrival, now_ms = place
        return replace(refusal, rank=rank, waiting=queued, arrival_us=arrival, now_ms=now_ms)

    @property
    def token(self) -> bytes | None:
        """This thread's token while it holds the lock, else ``None``."""
        return self.local.token

    @property
    def fence(self) -> int | None:
        """The fencing token of this thread's current hold, else ``None``.

        Fences of one lock name strictly increase across acquisitions. Pass it
        along with every write the lock protects, and have the store reject a
        write whose fence is lower than one it has already seen.
        """
        lease = self.local.lease
        return lease.fence if lease is not None and self.local.token is not None else None

    @property
    def lost(self) -> bool:
        """``True`` if this thread's hold is known lost or has outlived its validity."""
        lease = self.local.lease
        if lease is None or lease.released:
            return lease is not None and lease.lost
        return lease.lost or lease.remaining() <= 0.0

    def remaining(self) -> float:
        """Seconds of validity left to this thread's hold (``inf`` without a timeout)."""
        lease = self.local.lease
        if lease is None or self.local.token is None:
            return 0.0
        return lease.remaining()

    def _send_renew(self, token: bytes, ms: int, replace: bool) -> int:
        args = ("1" if replace else "0", token, ms)
        if self.replication is None:
            (pttl_ms,) = RENEW(self.redis, (self.name,), args)
        else:
            (pttl_ms,) = replicated.renew(
                self.redis, (self.name,), args, self.replication, self.label
            )
        return int(pttl_ms)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} timeout={self.timeout}>"


_PLAIN = Lock.do_acquire


def waiting_time(clock: Clock) -> tuple[Clock, Callable[[float], None]]:
    """The clock and the sleep that a blocking acquire waits with.

    With the default clock, those of redis-py's lock module
    (``redis.lock.mod_time``, looked up at every acquire), which redis-py's
    own ``Lock`` waits with: a test that fakes the time of redis-py's lock by
    patching that module fakes it for this lock too, as it should for a lock
    passed as ``client.lock(name, lock_class=Lock)``. A clock given to the
    lock is used as it is, with ``time.sleep``.
    """
    if clock is not time.monotonic:
        return clock, time.sleep
    timer = getattr(redis.lock, "mod_time", time)
    return timer.monotonic, timer.sleep
