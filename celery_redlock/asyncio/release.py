"""How an asyncio hold ends: ``release()`` a cancellation cannot cut, and the ``async with`` exit.

:class:`ReleasableLock` sits between
:class:`~celery_redlock.asyncio.extension.ExtendableLock` and the asyncio
``Lock`` and ``Semaphore``: the lease's bookkeeping, the renewal task's end,
the release round trip finished even when the caller is cancelled, and the
give-back of what a cancelled acquire took. Each class sends its own round
trip (:meth:`ReleasableLock._send_release`) and names its hold in errors and
log lines (:class:`~celery_redlock.core.hold.Wording`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, ClassVar

from redis.exceptions import RedisError

from celery_redlock.core.exceptions import LockError
from celery_redlock.core.hold import LOCK, Wording

from .extension import ExtendableLock
from .scripts import InFlight
from .shielding import cancel_requests, detach, settle
from .task_state import TaskState

__all__ = ["ReleasableLock", "granted"]


class ReleasableLock(ExtendableLock):
    """A per-task lock whose release finishes whatever cancels its caller."""

    #: The words of this class's errors and log lines.
    _wording: ClassVar[Wording] = LOCK
    #: The logger of the class's own module, which its log lines keep.
    _logger: ClassVar[logging.Logger]

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.release()
        except LockError:
            if self.raise_on_release_error:
                raise
            self._logger.warning(
                self._wording.subject + " was lost before the async with block ended", self.name
            )

    def release(self) -> Coroutine[Any, Any, None]:
        """Release the hold of the calling task (see the lock classes)."""
        return self._release(self._bound())

    async def _release(self, state: TaskState | None) -> None:
        if state is None:
            state = self._state()
        token = state.token
        if token is None:
            raise LockError(self._wording.unheld, lock_name=self.name)
        state.token = None
        lease = state.lease
        if lease is not None:
            # Flag first, so a renewal racing with the delete reports no loss.
            lease.released = True
            lease.on_lost = None
        if state.renewal is not None:
            state.renewal.cancel()
            state.renewal = None
        failure: BaseException | None = None
        if self._inline:
            asked = cancel_requests()
            try:
                owned = bool(await self._send_release(token))
                # A cancellation redis-py swallowed while connecting still counts.
                cancelled = cancel_requests() > asked
            except (InFlight, asyncio.CancelledError) as stopped:
                # Cancelled: the release finishes first, from where it was (in
                # flight), or whole (not sent yet).
                deletion = detach(
                    stopped.finish
                    if isinstance(stopped, InFlight)
                    else self._send_release_whole(token)
                )
                await settle(deletion)
                cancelled = True
                if deletion.cancelled():  # the loop is shutting down under us
                    raise asyncio.CancelledError() from None
                failure = deletion.exception()
                owned = failure is None and granted(deletion.result())
        else:
            deletion = detach(self._send_release(token))
            cancelled = await settle(deletion)
            if deletion.cancelled():  # the loop is shutting down under us
                raise asyncio.CancelledError()
            failure = deletion.exception()
            owned = failure is None and bool(deletion.result())
        if failure is None and not owned:
            failure = self._wording.lost_at_release(lease, self.name)
        if cancelled:
            raise asyncio.CancelledError()
        if failure is not None:
            raise failure

    @property
    def _inline(self) -> bool:
        """Whether round trips run in the caller, settled in the background only if cancelled."""
        return False

    async def _send_release(self, token: bytes) -> bool:
        """One release round trip: ``True`` if ``token`` held and is given back."""
        raise NotImplementedError

    def _send_release_whole(self, token: bytes) -> Coroutine[Any, Any, Any]:
        """The release round trip of an inline class, sent whole (it was cancelled before)."""
        return self._send_release(token)

    async def _undo(self, token: bytes) -> None:
        """Give back what an acquisition cancelled mid-flight may have taken."""
        try:
            await self._send_release(token)
        except RedisError as exc:
            self._logger.warning(
                self._wording.subject + " taken by a cancelled acquire could not be released "
                "(%r); it expires within %ss",
                self.name,
                exc,
                self.timeout,
            )


def granted(reply: Any) -> bool:
    """Whether a script's reply read after a cancellation says it took (or deleted) the key.

    ACQUIRE answers a fence (an integer) when it took the lock and a table
    when it did not; RELEASE answers 1 when it deleted the key.
    """
    return isinstance(reply, int) and reply > 0
