"""The result of a ``SingletonTask`` call: ``get()`` knows that a skipped duplicate never runs.

A duplicate skipped under ``lock_on_conflict="skip"`` records the state
``SKIPPED``, which is not one of Celery's ready states, so a plain
``AsyncResult.get()`` would wait for ever (or until its timeout). Here ``get()``
looks at the state between short waits and, once it reads ``SKIPPED``, raises
:class:`~celery_redlock.DuplicateSkipped` naming the holder and the key (or
returns it, with ``propagate=False``, as Celery does for a failure). The state
itself stays ``SKIPPED`` for Flower and ``AsyncResult.state``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.backends.base import DisabledBackend
from celery.exceptions import TimeoutError as ResultTimeout
from celery.result import AsyncResult
from celery.states import READY_STATES

from celery_redlock.core.exceptions import DuplicateSkipped

__all__ = [
    "RESULT_GRACE",
    "SKIPPED",
    "SUPERSEDED",
    "SingletonResult",
    "already_done",
    "skipped_error",
]

logger = logging.getLogger(__name__)

#: Task state recorded for a call skipped because a duplicate held the lock.
#: Not a Celery ready state: :meth:`SingletonResult.get` raises
#: :class:`~celery_redlock.DuplicateSkipped` for it.
SKIPPED = "SKIPPED"

#: Task state recorded for a call that a newer call of the same key replaced
#: (``lock_mode="debounce"``, ``lock_keep="latest"``); its meta names the
#: replacing task id under ``"by"``. :meth:`SingletonResult.get` follows it.
SUPERSEDED = "SUPERSEDED"

# The first wait for a ready state, doubled up to the last: a skip is usually
# recorded within milliseconds of the publish, a real result may take minutes.
_FIRST_WAIT = 0.05
_LONGEST_WAIT = 1.0

#: Seconds a copy that met its own task's lock, once it holds the lock, waits
#: for the earlier delivery's result to appear before running the task itself.
RESULT_GRACE = 1.0
RESULT_POLL = 0.02


def skipped_error(task_id: str, info: Any) -> DuplicateSkipped:
    """The error of the skipped call ``task_id``, from the meta its skip recorded."""
    meta = info if isinstance(info, dict) else {}
    holder, key = meta.get("holder"), meta.get("key")
    where = f" on {meta['holder_hostname']}" if meta.get("holder_hostname") else ""
    return DuplicateSkipped(
        f"task {task_id} was skipped as a duplicate: task {holder or 'unknown'}{where} "
        f"held {key or 'its lock'}",
        lock_name=key,
        task_id=task_id,
        holder=holder,
    )


class SingletonResult(AsyncResult):  # type: ignore[misc]  # Celery is untyped
    """An ``AsyncResult`` whose :meth:`get` returns promptly for a skipped duplicate.

    For a call another call superseded (state ``SUPERSEDED``), :meth:`get`
    follows the replacing copy (and its own replacement, if any) and returns
    the result of the run that served the call.
    """

    def get(
        self,
        timeout: float | None = None,
        propagate: bool = True,
        interval: float = 0.5,
        **options: Any,
    ) -> Any:
        """Wait for the result as ``AsyncResult.get`` does; a ``SKIPPED`` call ends the wait.

        A ``SUPERSEDED`` call waits for the copy that replaced it instead, within
        the same ``timeout``.

        Raises:
            DuplicateSkipped: The call was skipped (with ``propagate``; without,
                the error is returned).
            celery.exceptions.TimeoutError: Nothing ready within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = _FIRST_WAIT
        current: AsyncResult = self
        followed = {self.id}
        while True:
            state = current.state
            if state == SUPERSEDED:
                # The call was served by the copy that replaced it: wait for that one.
                _stop_waiting(current)
                replacement = self._replacement(current)
                if isinstance(replacement, DuplicateSkipped):
                    if propagate:
                        raise replacement
                    return replacement
                current = replacement
                if current.id not in followed:
                    followed.add(current.id)
                    continue
                # Back to a copy already followed: two copies name each other for
                # a moment (the store lost the generation and a redelivered copy
                # registered again). Wait on it as on any pending result, within
                # the timeout, rather than spinning between them.
            if state == SKIPPED:
                _stop_waiting(current)
                error = skipped_error(current.id, current.info)
                if propagate:
                    raise error
                return error
            left = None if deadline is None else deadline - time.monotonic()
            step = wait if left is None else max(0.0, min(wait, left))
            try:
                return AsyncResult.get(
                    current,
                    timeout=step,
                    propagate=propagate,
                    interval=min(interval, step),
                    **options,
                )
            except ResultTimeout:
                if left is not None and left <= step:
                    raise
            wait = min(wait * 2, _LONGEST_WAIT)

    @property
    def superseded_by(self) -> str | None:
        """The task id of the copy that replaced this call (state ``SUPERSEDED``), else ``None``."""
        if self.state != SUPERSEDED:
            return None
        info = self.info
        return info.get("by") if isinstance(info, dict) else None

    def _replacement(self, result: AsyncResult) -> AsyncResult | DuplicateSkipped:
        info = result.info
        by = info.get("by") if isinstance(info, dict) else None
        if not by or by == result.id:
            return DuplicateSkipped(
                f"task {result.id} was superseded by an unknown copy",
                lock_name=info.get("key") if isinstance(info, dict) else None,
                task_id=result.id,
                holder=None,
            )
        return AsyncResult(by, backend=self.backend, app=self.app)


def _stop_waiting(result: AsyncResult) -> None:
    """Stop listening for ``result``, which ends without a ready state.

    Celery stops listening for a result when it turns ready. SKIPPED and
    SUPERSEDED are not ready states, so a result backend that pushes results
    (Redis pub/sub) would stay subscribed until the result object is garbage
    collected, which at interpreter exit can mean reconnecting to unsubscribe
    while Python shuts down.
    """
    try:
        result.backend.remove_pending_result(result)
    except Exception as exc:  # a courtesy to the backend; the outcome is already known
        logger.debug("could not stop waiting for %s: %s", result.id, exc)


def already_done(task: Any, task_id: str) -> bool:
    """Whether an earlier delivery of ``task_id`` of ``task`` finished, by its stored state.

    That delivery releases its lock just before Celery stores its result,
    so a copy that took the lock in between would see no result yet and
    run the task again: a state that is not ready is read again for up to
    :data:`RESULT_GRACE` seconds. Only a delivery that died (no result,
    ever) costs the copy that wait.
    """
    if isinstance(task.backend, DisabledBackend):
        return False
    deadline = time.monotonic() + RESULT_GRACE
    while True:
        try:
            if task.AsyncResult(task_id).state in READY_STATES:
                return True
        except Exception:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(RESULT_POLL)
