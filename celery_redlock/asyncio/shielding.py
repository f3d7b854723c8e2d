"""Round trips that a cancellation must not cut in half.

Cancelling a coroutine while it waits for a Redis reply leaves the command's
effect unknown: the server may have run it. For the lock that is the difference
between holding a key and not, so the acquire and release round trips finish
in tasks that a cancellation of the caller does not reach: a single server's
round trip once a cancellation hands it over
(:class:`~celery_redlock.asyncio.scripts.InFlight`), a Redlock fan-out from the
start. The caller still gets its ``CancelledError``, but only once the round
trip (and whatever must undo it) has finished, so on return the lock's state is
known.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["cancel_requests", "detach", "drain", "settle"]

T = TypeVar("T")

# The event loop keeps only weak references to tasks: a detached task that
# nobody awaits any more must be kept alive here until it ends.
_running: set[asyncio.Task[Any]] = set()


def detach(coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run ``coroutine`` as a task that survives the caller's cancellation."""
    task = asyncio.ensure_future(coroutine)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


async def settle(task: asyncio.Future[T]) -> bool:
    """Wait until ``task`` is done, through any number of cancellations.

    Returns ``True`` if the caller was cancelled meanwhile; the caller must then
    raise ``CancelledError`` itself once it has dealt with the outcome. The
    task's own result or exception is left on it.
    """
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            # Either we were cancelled (the task goes on: keep waiting), or the
            # task itself was (the loop is shutting down: it is done).
            if not task.done():
                cancelled = True
        except Exception:
            pass  # the outcome stays on the task, for the caller to read
    return cancelled


async def drain(timeout: float | None = None) -> bool:
    """Wait for the lock's round trips still running in the background on this loop.

    Redlock leaves a request to a slow master running after the vote is
    decided, and sends a late release behind it (see
    :mod:`celery_redlock.asyncio.redlock`). Await this before closing the
    clients or the event loop, so those releases go out. Returns ``True`` if
    all finished, ``False`` if ``timeout`` seconds passed first.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        ours = [task for task in _running if task.get_loop() is loop]
        if not ours:
            return True
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            return False
        # A finished request can start its follow-up: look again until none is left.
        await asyncio.wait(ours, timeout=left)


def cancel_requests() -> int:
    """How many cancellations of the current task are pending (0 before Python 3.11)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return int(cancelling()) if cancelling is not None else 0
