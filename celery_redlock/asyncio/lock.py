"""A token lock on one Redis server for ``redis.asyncio``, with fencing and auto-renewal.

Semantics follow :class:`celery_redlock.Lock` (same scripts, same :class:`Lease`),
with three differences that asyncio needs:

* State is per task, not per thread. All tasks of an event loop share one
  thread, so ``threading.local`` would let one task release another's hold.
  Each method looks its task up when it is *called*, not when it is first
  awaited, so ``asyncio.wait_for(lock.acquire(), ...)`` (which runs the
  coroutine in a task of its own before Python 3.12) still records the hold for
  the caller (:mod:`.task_state`).
* Renewal is an asyncio task per lease (:mod:`.renewal`), not the watchdog thread.
* Cancellation never cuts a round trip in half. A cancelled ``acquire`` waits
  for its ``SET NX`` to answer and releases what it took before raising
  ``CancelledError``; a cancelled ``release`` finishes deleting the key first.

Round trips: acquire 1, release 1, extend 1, reacquire 1 (:mod:`.extension`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import redis.asyncio.lock

from celery_redlock.core.exceptions import LockError
from celery_redlock.core.hold import lock_not_acquired
from celery_redlock.core.lease import DEFAULT_DRIFT_FACTOR, Clock, Lease, LostCallback
from celery_redlock.core.lock_options import DEFAULT_FENCE_RETENTION, Number
from celery_redlock.core.scripts import ACQUIRE, RELEASE

from .release import ReleasableLock, granted
from .renewal import Renewer, keep_alive, renew_on
from .scripts import InFlight, run_script
from .shielding import cancel_requests, detach, settle
from .task_state import TaskState

__all__ = ["Lock"]

logger = logging.getLogger(__name__)

_LockT = TypeVar("_LockT", bound="Lock")


class Lock(ReleasableLock):
    """A distributed lock on one Redis server for ``redis.asyncio`` clients.

    Compatible with ``redis.asyncio.lock.Lock`` (``client.lock(name,
    lock_class=celery_redlock.asyncio.Lock)`` works) where both define behaviour.

    Args:
        redis: A ``redis.asyncio.Redis`` client (``decode_responses`` either way).
        name: The Redis key of the lock.
        timeout: Time to live in seconds; ``None`` keeps the lock until released.
        sleep: Seconds between attempts while blocking.
        blocking: Whether ``acquire()`` waits for the lock by default.
        blocking_timeout: Longest wait in seconds; ``None`` waits forever.
        thread_local: Keep the token per asyncio task (the name is redis-py's);
            ``False`` shares one hold between all tasks using this object.
        raise_on_release_error: Whether leaving the ``async with`` block raises
            when the lock was lost meanwhile (otherwise it logs a warning).
        auto_renew: Keep the lock alive from an asyncio task while held. Needs a
            ``timeout``; renews at a third of it.
        on_lost: Called with the :class:`Lease` when it is found lost; runs on the
            event loop, keep it short and non-blocking.
        fencing: Draw a fencing token on each acquisition (same round trip).
        fence_key: Override the fence counter's key (default: the store's
            counter, one per hash slot on Cluster: ``fence_key_for(name)``).
        fence_retention: Seconds the fence counter outlives its latest draw.
        drift_factor: Share of the TTL deducted from local validity for clock drift.
        clock: Monotonic clock in seconds; injectable for tests.
        label: Who holds the lock, for log lines.

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
        clock: Clock = time.monotonic,
        label: str | None = None,
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
        )
        self._keep_state_per_task()

    # -- redis-py compatible API ----------------------------------------------------

    async def __aenter__(self: _LockT) -> _LockT:
        if await self.acquire():
            return self
        raise self._not_acquired(self._state())

    def _not_acquired(self, state: TaskState) -> LockError:
        """Build the error an ``async with`` block raises when the lock could not be taken."""
        return lock_not_acquired(self.name, state.holder)

    def acquire(
        self,
        sleep: Number | None = None,
        blocking: bool | None = None,
        blocking_timeout: Number | None = None,
        token: str | bytes | None = None,
    ) -> Coroutine[Any, Any, bool]:
        """Take the lock; the awaitable gives ``True`` once held, ``False`` if not.

        Args:
            sleep: Seconds between attempts (default: the lock's ``sleep``).
            blocking: Wait for the lock (default: the lock's ``blocking``).
            blocking_timeout: Longest wait in seconds (default: the lock's).
            token: Value to store; default 16 random bytes from ``secrets``, hex.

        Raises:
            redis.exceptions.RedisError: If Redis cannot be reached.
            asyncio.CancelledError: If cancelled; whatever the attempt in flight
                took is released before this is raised.
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
        if state is None:
            state = self._state()
        if sleep is None:
            sleep = self.sleep
        if blocking is None:
            blocking = self.blocking
        if blocking_timeout is None:
            blocking_timeout = self.blocking_timeout
        encoded = secrets.token_hex(16).encode() if token is None else self._encode_token(token)
        # The wait is measured on the loop's clock, as asyncio.sleep and
        # asyncio.timeout measure it (a virtual-time test loop included); lock
        # validity stays on the real clock, which the server's TTL runs on.
        # Both come from the asyncio that redis-py's asyncio lock module sees,
        # as its Lock's wait does: a test that fakes that module's time for
        # redis-py's lock (patching its ``asyncio``) fakes it for this one too.
        timer = getattr(redis.asyncio.lock, "asyncio", asyncio)
        now = timer.get_running_loop().time
        stop_trying_at = None
        if blocking_timeout is not None:
            stop_trying_at = now() + blocking_timeout
        retry = False
        while True:
            value = await self._attempt(state, encoded, retry)
            if value is not None:
                state.token = value
                lease = state.lease
                if self.auto_renew and lease is not None:
                    state.renewal = detach(keep_alive(lease, self._renewer(), self._clock))
                return True
            if not blocking:
                return False
            delay = self._retry_delay(sleep)
            if stop_trying_at is not None and now() + delay > stop_trying_at:
                return False
            await timer.sleep(delay)
            retry = True

    def _retry_delay(self, sleep: Number) -> float:
        """Seconds to wait before the next attempt of a blocking acquire."""
        return float(sleep)

    def _attempt_value(self, state: TaskState, token: bytes, retry: bool) -> bytes:
        """The value one attempt stores: the token itself here."""
        return token

    async def _attempt(self, state: TaskState, token: bytes, retry: bool) -> bytes | None:
        """Make one attempt; on success store the new lease in ``state``, return its value."""
        token = self._attempt_value(state, token, retry)
        sent_at = self._clock()
        if self._inline:
            asked = cancel_requests()
            try:
                acquired, reply = await self._send_acquire(token)
            except InFlight as flight:
                # Cancelled with the acquire in flight: learn what it took, give it back.
                await self._give_back(detach(flight.finish), token, granted)
                raise asyncio.CancelledError() from None
            if cancel_requests() > asked:
                # redis-py swallows a cancellation that comes while it connects,
                # and goes on: the caller still asked to stop, so give back.
                if acquired:
                    await settle(detach(self._undo(token)))
                raise asyncio.CancelledError()
        else:
            attempt = detach(self._send_acquire(token))
            if await settle(attempt):
                await self._give_back(attempt, token, lambda reply: reply[0])
                raise asyncio.CancelledError()
            acquired, reply = attempt.result()
        if not acquired:
            self._refused(state, reply)
            return None
        state.holder = None
        state.failure = None
        state.lease = Lease(
            client=self.redis,
            name=self.name,
            token=token,
            fence=reply,
            ttl=self.timeout,
            sent_at=sent_at,
            clock=self._clock,
            drift_factor=self.drift_factor,
            on_lost=self.on_lost,
            owner=self,
            label=self.label,
        )
        return token

    def _refused(self, state: TaskState, reply: Any) -> None:
        """Record in ``state`` why an attempt failed, from ``_send_acquire``'s reply."""
        state.holder = reply

    async def _send_acquire(self, token: bytes) -> tuple[bool, Any]:
        """One acquire round trip: ``(True, fence)`` or ``(False, (holder, holder_ttl))``."""
        if not self.fencing:
            taken = await self.redis.set(self.name, token, nx=True, px=self._ttl_ms or None)
            return (True, None) if taken else (False, None)
        reply = await run_script(
            ACQUIRE,
            self.redis,
            (self.name, self.fence_key),
            (token, self._ttl_ms, self._fence_retention_ms, "0"),
            hand_over=self._inline,
        )
        if isinstance(reply, list):
            holder_ttl_ms, holder = reply
            return False, (
                holder.decode("utf-8", "replace") if isinstance(holder, bytes) else holder,
                holder_ttl_ms / 1000 if holder_ttl_ms >= 0 else None,
            )
        return True, int(reply)

    def _renewer(self) -> Renewer:
        """How the renewal task renews this lock's leases (must not hold ``self``)."""
        return renew_on(self.redis)

    @property
    def _inline(self) -> bool:
        """Whether round trips run in the caller, settled in the background only if cancelled.

        A single server's script round trip can be handed over mid-flight
        (:class:`~celery_redlock.asyncio.scripts.InFlight`); anything else
        (``SET NX`` without fencing, a Redlock fan-out) runs in a task of its
        own, which costs an event-loop pass or two per operation.
        """
        return self.fencing

    async def _give_back(
        self, outcome: asyncio.Future[Any], token: bytes, took: Callable[[Any], bool]
    ) -> None:
        """Wait (through cancellations) for a cancelled acquire's outcome; undo a grant."""
        await settle(outcome)
        if not outcome.cancelled() and outcome.exception() is None and took(outcome.result()):
            await settle(detach(self._undo(token)))

    async def locked(self) -> bool:
        """Return ``True`` if anyone holds the lock (one ``GET``)."""
        return await self.redis.get(self.name) is not None

    def owned(self) -> Coroutine[Any, Any, bool]:
        """Return ``True`` if this task's token is the lock's value (one ``GET``)."""
        return self._owned(self._bound())

    async def _owned(self, state: TaskState | None) -> bool:
        token = (state or self._state()).token
        if token is None:
            return False
        stored = await self.redis.get(self.name)
        if isinstance(stored, str):
            stored = self._encode_token(stored)
        return bool(stored == token)

    def release(self) -> Coroutine[Any, Any, None]:
        """Release the lock if this task's token still holds it.

        A cancellation while the delete is in flight waits for it to finish, so
        the lock is never left held by a task that no longer knows it.

        Raises:
            LockError: If this task does not hold the lock.
            LockNotOwned: If the lock expired or was taken over meanwhile.
        """
        return self._release(self._bound())

    async def _send_release(self, token: bytes) -> bool:
        """One release round trip: ``True`` if the lock held ``token`` and is deleted."""
        reply = await run_script(
            RELEASE, self.redis, (self.name,), (token, "0"), hand_over=self._inline
        )
        return bool(reply)

    def _send_release_whole(self, token: bytes) -> Coroutine[Any, Any, Any]:
        return run_script(RELEASE, self.redis, (self.name,), (token, "0"))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} timeout={self.timeout}>"
