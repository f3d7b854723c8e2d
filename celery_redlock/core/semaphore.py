"""A semaphore on one Redis server: up to N holders of a name at once, each with its own permit.

Each acquisition takes one *permit*: a member of a sorted set scored by its
expiry, carrying the holder's own random token, a slot (0 to N - 1) and a
fencing token drawn from the name's fence counter, so fences of a name strictly
increase across permits (and across a :class:`~celery_redlock.Lock` of the same
name). A holder that crashes never leaks its slot for longer than its TTL:
every acquire first removes the permits that expired, in the same script. The
watchdog renews permits like locks, batched with them; a permit found gone is
``lost`` and its ``on_lost`` runs. See docs/limits.md.

Round trips: acquire 1, release 1, extend 1, reacquire 1.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .exceptions import LockError
from .hold import PERMIT, PerThreadLock
from .holder import Refusal
from .lease import DEFAULT_DRIFT_FACTOR, Clock, LostCallback
from .lock_options import DEFAULT_FENCE_RETENTION, Number, positive_seconds
from .permit import PermitLease
from .queue_scripts import LEAVE_LINE, Place, queue_keys
from .semaphore_scripts import ACQUIRE_PERMIT, COUNT_PERMITS, RELEASE_PERMIT, RENEW_PERMITS
from .semaphore_settings import SemaphoreSettings

if TYPE_CHECKING:
    from .renewal import Watchdog

__all__ = ["Semaphore"]

logger = logging.getLogger(__name__)

_SemaphoreT = TypeVar("_SemaphoreT", bound="Semaphore")


class Semaphore(SemaphoreSettings, PerThreadLock):
    """Up to ``limit`` holders of ``name`` at once, each with its own permit, lease and fence.

    The interface is :class:`~celery_redlock.Lock`'s: ``acquire``, ``release``,
    ``extend``, ``reacquire``, ``lease``, ``fence``, ``lost``, ``refusal``,
    and ``with``. A blocking acquire waits its turn on a wait list kept in
    Redis: first come, first served, so no waiter starves however many new
    callers arrive; between attempts it blocks on a list that every release
    pushes to, so a freed permit wakes it at once.

    Args:
        redis: A ``redis.Redis`` client (one server, Sentinel or Cluster).
        name: The semaphore's name; its keys share its Cluster hash slot.
        limit: Most holders at once.
        timeout: Each permit's time to live in seconds (required: a crashed
            holder's permit frees once it expires).
        sleep: Longest wait between attempts while blocking.
        blocking: Whether ``acquire()`` waits for a permit by default.
        blocking_timeout: Longest wait in seconds; ``None`` waits forever.
        thread_local: Keep the permit per thread, as the lock does.
        raise_on_release_error: Whether leaving the ``with`` block raises when
            the permit was lost meanwhile (otherwise it logs a warning).
        auto_renew: Renew the permit from the watchdog thread while held.
        on_lost: Called with the :class:`PermitLease` when it is found lost.
        fence_retention: Seconds the fence counter outlives its latest draw.
        drift_factor: Share of the TTL deducted from local validity for clock drift.
        watchdog: The watchdog to renew with (default: the process-wide one).
        clock: Monotonic clock in seconds; injectable for tests.
        label: Who holds the permit, for log lines.

    Raises:
        ConfigurationError: If an argument is out of range, naming it.
    """

    _wording = PERMIT
    _logger = logger

    def __init__(
        self,
        redis: Any,
        name: str,
        *,
        limit: int,
        timeout: Number,
        sleep: Number = 0.1,
        blocking: bool = True,
        blocking_timeout: Number | None = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
        auto_renew: bool = False,
        on_lost: LostCallback | None = None,
        fence_retention: Number = DEFAULT_FENCE_RETENTION,
        drift_factor: float = DEFAULT_DRIFT_FACTOR,
        watchdog: Watchdog | None = None,
        clock: Clock = time.monotonic,
        label: str | None = None,
    ) -> None:
        self._check_limit(limit, timeout)
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
            fencing=True,
            fence_key=None,
            fence_retention=fence_retention,
            drift_factor=drift_factor,
            clock=clock,
            label=label,
        )
        self._name_keys()
        self._watchdog = watchdog
        self._fresh_state()

    def __enter__(self: _SemaphoreT) -> _SemaphoreT:
        if self.acquire():
            return self
        raise self._no_permit(self.refusal)

    def acquire(
        self,
        sleep: Number | None = None,
        blocking: bool | None = None,
        blocking_timeout: Number | None = None,
        token: str | bytes | None = None,
        place: Place | None = None,
    ) -> bool:
        """Take a permit; return ``True`` once held, ``False`` if not (non-blocking or timed out).

        A blocking acquire joins the wait list and is admitted in arrival
        order; one that times out leaves the list.

        Args:
            sleep: Longest wait between attempts (default: the semaphore's).
            blocking: Wait for a permit (default: the semaphore's ``blocking``).
            blocking_timeout: Longest wait in seconds (default: the semaphore's).
            token: The holder's token; default 16 random bytes from ``secrets``,
                hex. A token naming a task (the package's holder value) is
                refused while another permit names the same task id.
            place: Wait in line as this place (see
                :mod:`~celery_redlock.core.queue_scripts`): its member, first
                arrival and entry lifetimes instead of the token and now.

        Raises:
            LockError: If this thread (or, with ``thread_local=False``, any
                thread) holds a permit of this object already.
            redis.exceptions.RedisError: If Redis cannot be reached.
        """
        self._one_permit_each(self.local)
        pause, blocking, blocking_timeout, encoded, owner, wait_ms = self._acquire_plan(
            sleep, blocking, blocking_timeout, token
        )
        if place is not None:
            wait_ms = max(wait_ms, place.far_ms)
        stop_at = None if blocking_timeout is None else self._clock() + blocking_timeout
        while True:
            if self.do_acquire(encoded, owner, wait_ms, place):
                lease = self.local.lease
                if self.auto_renew and lease is not None:
                    self.watchdog.watch(lease)
                return True
            if not blocking:
                return False
            wait = pause
            if stop_at is not None:
                left = stop_at - self._clock()
                if left <= 0:
                    member = encoded if place is None else place.member
                    LEAVE_LINE(self.redis, queue_keys(self.name), (member,))
                    return False
                wait = min(wait, left)
            self._wait(wait)

    def _wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a release to push to the wake list."""
        if seconds <= 0:
            return
        if self._blpop:
            try:
                self.redis.blpop([self.keys.wake], timeout=seconds)
                return
            except RedisTimeoutError:
                return  # the client's socket timeout is shorter: just try again
            except ResponseError:
                # A server before Redis 6 takes whole seconds only: sleep instead.
                self._blpop = False
        time.sleep(seconds)

    def do_acquire(
        self, token: bytes, owner: str = "", wait_ms: int = 0, place: Place | None = None
    ) -> bool:
        """Make one attempt; on success store the new :class:`PermitLease` for this thread.

        Args:
            token: The holder's token.
            owner: The task id field of the token (see :meth:`Holder.owner_field`).
            wait_ms: 0, or how long the caller's place on the wait list lasts.
            place: The caller's place in line, when it waits as a call (not as the token).
        """
        sent_at = self._clock()
        args: tuple[Any, ...] = (
            token,
            self._ttl_ms,
            self.limit,
            self._fence_retention_ms,
            owner,
            wait_ms,
            "0",
        )
        keys: tuple[str, ...] = self._acquire_keys
        if place is not None:
            args += place.args()[:3]
            keys = (*keys, queue_keys(self.name)[2])
        reply = ACQUIRE_PERMIT(self.redis, keys, args)
        if reply[0] != 1:
            self.local.refusal = self._refusal(reply, place is not None)
            return False
        self._keep_first_permit(self._permit(reply, sent_at))
        return True

    def _fresh_state(self) -> None:
        super()._fresh_state()
        # Makes the check that the hold is empty and the store of a new permit
        # one step: with thread_local=False, two threads granted at once would
        # otherwise both pass the check, and the permit stored first would be
        # overwritten, out of reach of any release.
        self._hold_guard = threading.Lock()

    def _keep_first_permit(self, lease: PermitLease) -> None:
        """Store ``lease`` in the hold; or give it back if another thread's acquire filled it.

        Raises:
            LockError: If the hold has a live permit already (``lease`` is given back).
        """
        with self._hold_guard:
            try:
                self._one_permit_each(self.local)
            except LockError as exc:
                refused = exc
            else:
                self.local.refusal = None
                self.local.token = lease.token
                self.local.lease = lease
                return
        try:
            self._give_back(lease.token)
        except RedisError as exc:
            # The caller's mistake is what it must hear of; the permit is not
            # renewed, so it frees itself.
            logger.warning(
                "%s, granted to a holder that has one, could not be given back (%r); "
                "it expires within %ss",
                lease.describe(),
                exc,
                self.timeout,
            )
        raise refused

    def _refusal(self, reply: list[Any], in_line: bool) -> Refusal:
        _, pttl_ms, value, held, waiting, rank, arrival, now_ms = reply
        return Refusal(
            value.decode("utf-8", "replace") if isinstance(value, bytes) else value,
            pttl_ms / 1000 if pttl_ms >= 0 else None,
            int(held),
            self.limit,
            int(waiting),
            rank=int(rank) if in_line and int(rank) >= 0 else None,
            arrival_us=int(float(arrival)) if in_line and float(arrival) >= 0 else None,
            now_ms=int(now_ms),
        )

    def release(self) -> None:
        """Give this thread's permit back, if it still holds it.

        Raises:
            LockError: If this thread holds no permit.
            LockNotOwned: If the permit expired and was reclaimed meanwhile;
                no other permit is touched.
        """
        super().release()

    def do_release(self, expected_token: bytes) -> None:
        """Run the release script: remove exactly this permit, wake a waiter if any."""
        if not self._give_back(expected_token):
            raise PERMIT.lost_at_release(self.local.lease, self.name)

    def _give_back(self, token: bytes) -> bool:
        """Remove the permit ``token`` names, waking a waiter if any; whether it was there."""
        args = (token, "0", self._ttl_ms, self.limit)
        return bool(RELEASE_PERMIT(self.redis, self._release_keys, args))

    def extend(self, additional_time: Number, replace_ttl: bool = False) -> Literal[True]:
        """Add ``additional_time`` seconds to the permit's time left, or set it to that.

        Raises:
            LockError: If this thread holds no permit.
            ConfigurationError: If ``additional_time`` is not positive.
            LockNotOwned: If the permit was lost meanwhile.
        """
        if self.local.token is None:
            raise LockError("Cannot extend a permit that's not held", lock_name=self.name)
        positive_seconds("additional_time", additional_time, allow_none=False)
        self._renew(int(additional_time * 1000), replace_ttl, "extend")
        return True

    def reacquire(self) -> Literal[True]:
        """Reset the permit's time left to ``timeout``.

        Raises:
            LockError: If this thread holds no permit.
            LockNotOwned: If the permit was lost meanwhile.
        """
        if self.local.token is None:
            raise LockError("Cannot reacquire a permit that's not held", lock_name=self.name)
        self._renew(self._ttl_ms, True, "reacquire")
        return True

    def _send_renew(self, token: bytes, ms: int, replace: bool) -> int:
        args = ("1" if replace else "0", token, ms)
        (left_ms,) = RENEW_PERMITS(self.redis, (self.keys.permits,), args)
        return int(left_ms)

    def held(self) -> int:
        """How many permits are held now (one round trip)."""
        return int(COUNT_PERMITS(self.redis, (self.keys.permits,), ()))

    def locked(self) -> bool:
        """Return ``True`` if every permit is held (one round trip)."""
        return self.held() >= self.limit

    def owned(self) -> bool:
        """Return ``True`` if this thread's permit is still in the permits set (one ``ZSCORE``)."""
        token = self.local.token
        return token is not None and self.redis.zscore(self.keys.permits, token) is not None

    @property
    def lease(self) -> PermitLease | None:
        """This thread's latest permit: held, lost or released; ``None`` before any."""
        return cast("PermitLease | None", self.local.lease)

    @property
    def refusal(self) -> Refusal:
        """Why this thread's latest acquire was refused: a holder, how full, how many wait.

        The holder reported is one of this caller's own task when there is one
        (the acquire was refused for that reason), otherwise the permit that
        expires first; ``ttl`` is that permit's time left.
        """
        return self.local.refusal or Refusal()

    @property
    def token(self) -> bytes | None:
        """This thread's permit (its member in the permits set) while held, else ``None``."""
        return self.local.token

    @property
    def fence(self) -> int | None:
        """The fencing token of this thread's current permit, else ``None``."""
        lease = self.local.lease
        return lease.fence if lease is not None and self.local.token is not None else None

    @property
    def slot(self) -> int | None:
        """The slot of this thread's current permit, else ``None``."""
        lease = self.lease
        return lease.slot if lease is not None and self.local.token is not None else None

    @property
    def lost(self) -> bool:
        """``True`` if this thread's permit is known lost or has outlived its validity."""
        lease = self.local.lease
        if lease is None or lease.released:
            return lease is not None and lease.lost
        return lease.lost

    def remaining(self) -> float:
        """Seconds of validity left to this thread's permit."""
        lease = self.local.lease
        if lease is None or self.local.token is None:
            return 0.0
        return lease.remaining()

    @property
    def watchdog(self) -> Watchdog:
        """The watchdog that renews the permit when ``auto_renew`` is set."""
        return super().watchdog
