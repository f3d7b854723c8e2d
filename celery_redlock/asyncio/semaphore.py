"""The semaphore for ``redis.asyncio``: up to N holders of a name, each with its own permit.

The twin of :class:`celery_redlock.core.semaphore.Semaphore`: the same scripts,
the same :class:`~celery_redlock.core.semaphore.PermitLease`, the same wait
list (first come, first served). As for the asyncio lock, state is kept per
task (:mod:`.task_state`), a permit is renewed by an asyncio task of its own
(:mod:`.renewal`), and a cancellation never cuts a round trip in half: a
cancelled acquire learns what its script did and gives back a permit it took
before raising ``CancelledError``; a cancelled release finishes first.

Round trips: acquire 1, release 1, extend 1, reacquire 1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_redlock.core.exceptions import LockError
from celery_redlock.core.hold import PERMIT
from celery_redlock.core.holder import Refusal
from celery_redlock.core.lease import DEFAULT_DRIFT_FACTOR, Clock, Lease, LostCallback
from celery_redlock.core.lock_options import DEFAULT_FENCE_RETENTION, Number
from celery_redlock.core.permit import PermitLease
from celery_redlock.core.semaphore_scripts import (
    ACQUIRE_PERMIT,
    COUNT_PERMITS,
    LEAVE_WAIT_LIST,
    RELEASE_PERMIT,
    RENEW_PERMITS,
)
from celery_redlock.core.semaphore_settings import SemaphoreSettings

from .release import ReleasableLock
from .renewal import keep_alive, renew_on
from .scripts import run_script
from .shielding import detach, settle
from .task_state import TaskState

__all__ = ["Semaphore"]

logger = logging.getLogger(__name__)

_SemaphoreT = TypeVar("_SemaphoreT", bound="Semaphore")


class Semaphore(ReleasableLock, SemaphoreSettings):
    """Up to ``limit`` holders of ``name`` at once, for ``redis.asyncio`` clients.

    Takes the arguments of :class:`celery_redlock.Semaphore` (without
    ``watchdog``); ``thread_local`` keeps the permit per asyncio task.

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
        self._keep_state_per_task()
        self._name_keys()

    async def __aenter__(self: _SemaphoreT) -> _SemaphoreT:
        if await self.acquire():
            return self
        raise self._no_permit(self.refusal)

    def acquire(
        self,
        sleep: Number | None = None,
        blocking: bool | None = None,
        blocking_timeout: Number | None = None,
        token: str | bytes | None = None,
    ) -> Coroutine[Any, Any, bool]:
        """Take a permit; the awaitable gives ``True`` once held, ``False`` if not.

        Arguments as for :meth:`celery_redlock.Semaphore.acquire`.

        Raises:
            LockError: If this task (or, with ``thread_local=False``, any task)
                holds a permit of this object already; also when two acquires
                of one task run at once, for the one granted second, which
                gives its permit back first.
            redis.exceptions.RedisError: If Redis cannot be reached.
            asyncio.CancelledError: If cancelled; a permit the attempt in
                flight took is given back before this is raised.
        """
        return self._acquire(self._bound(), sleep, blocking, blocking_timeout, token)

    async def _acquire(
        self,
        state: TaskState | None,
        sleep: Number | None,
        blocking: bool | None,
        blocking_timeout: Number | None,
        token: str | bytes | None,
    ) -> bool:
        state = state or self._state()
        self._one_permit_each(state)
        pause, blocking, blocking_timeout, encoded, owner, wait_ms = self._acquire_plan(
            sleep, blocking, blocking_timeout, token
        )
        # The wait is measured on the loop's clock, as asyncio.sleep measures it.
        now = asyncio.get_running_loop().time
        stop_at = None if blocking_timeout is None else now() + blocking_timeout
        while True:
            if await self._attempt(state, encoded, owner, wait_ms):
                lease = state.lease
                if self.auto_renew and lease is not None:
                    state.renewal = detach(keep_alive(lease, renew_on(self.redis), self._clock))
                return True
            if not blocking:
                return False
            wait = pause
            if stop_at is not None:
                left = stop_at - now()
                if left <= 0:
                    await settle(self._leave(encoded))
                    return False
                wait = min(wait, left)
            try:
                await self._wait(wait)
            except asyncio.CancelledError:
                self._leave(encoded)  # runs on; the caller's cancellation goes through
                raise

    def _leave(self, token: bytes) -> asyncio.Task[Any]:
        """Leave the wait list, in a task a cancellation of the caller does not stop."""
        keys = (self.keys.waiters, self.keys.waiting)
        return detach(run_script(LEAVE_WAIT_LIST, self.redis, keys, (token,)))

    async def _wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a release to push to the wake list."""
        if seconds <= 0:
            return
        if self._blpop:
            try:
                await self.redis.blpop([self.keys.wake], timeout=seconds)
                return
            except RedisTimeoutError:
                return
            except ResponseError:
                self._blpop = False  # a server before Redis 6: whole seconds only
        await asyncio.sleep(seconds)

    async def _attempt(self, state: TaskState, token: bytes, owner: str, wait_ms: int) -> bool:
        """Make one attempt; on success store the new lease in ``state``."""
        sent_at = self._clock()
        args = (token, self._ttl_ms, self.limit, self._fence_retention_ms, owner, wait_ms, "0")
        attempt = detach(run_script(ACQUIRE_PERMIT, self.redis, self._acquire_keys, args))
        if await settle(attempt):
            # Cancelled with the attempt in flight: give back what it took.
            if not attempt.cancelled() and attempt.exception() is None:
                reply = attempt.result()
                if reply[0] == 1:
                    await settle(detach(self._undo(self._member(reply[3]))))
            raise asyncio.CancelledError()
        reply = attempt.result()
        if reply[0] != 1:
            _, pttl_ms, value, held, waiting = reply[:5]
            state.refusal = Refusal(
                value.decode("utf-8", "replace") if isinstance(value, bytes) else value,
                pttl_ms / 1000 if pttl_ms >= 0 else None,
                int(held),
                self.limit,
                int(waiting),
            )
            return False
        lease = self._permit(reply, sent_at)
        try:
            # Another acquire of this hold (gather in one task) may have won meanwhile.
            self._one_permit_each(state)
        except LockError:
            if await settle(detach(self._undo(lease.token))):
                # Cancelled meanwhile: that is what the caller's timeout or
                # task group goes by, not the LockError.
                raise asyncio.CancelledError() from None
            raise
        state.refusal = None
        state.token = lease.token
        state.lease = lease
        return True

    async def _send_release(self, member: bytes) -> bool:
        args = (member, "0", self._ttl_ms, self.limit)
        return bool(await run_script(RELEASE_PERMIT, self.redis, self._release_keys, args))

    def release(self) -> Coroutine[Any, Any, None]:
        """Give this task's permit back, if it still holds it.

        A cancellation while the release is in flight waits for it to finish.

        Raises:
            LockError: If this task holds no permit.
            LockNotOwned: If the permit expired and was reclaimed meanwhile.
        """
        return self._release(self._bound())

    async def _send_renew(self, lease: Lease, ms: int, replace: bool) -> int:
        """One renew round trip: the permit's new time left in ms, or 0 if not held."""
        args = ("1" if replace else "0", lease.token, ms)
        (left_ms,) = await run_script(RENEW_PERMITS, self.redis, (self.keys.permits,), args)
        return int(left_ms)

    async def held(self) -> int:
        """How many permits are held now (one round trip)."""
        return int(await run_script(COUNT_PERMITS, self.redis, (self.keys.permits,), ()))

    async def locked(self) -> bool:
        """Return ``True`` if every permit is held (one round trip)."""
        return await self.held() >= self.limit

    async def owned(self) -> bool:
        """Return ``True`` if this task's permit is still in the permits set."""
        token = self._state().token
        return token is not None and await self.redis.zscore(self.keys.permits, token) is not None

    @property
    def slot(self) -> int | None:
        """The slot of this task's current permit, else ``None``."""
        state = self._state()
        lease = state.lease
        if isinstance(lease, PermitLease) and state.token is not None:
            return lease.slot
        return None
