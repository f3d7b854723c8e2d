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

import time
from typing import Any

from celery.exceptions import TimeoutError as ResultTimeout
from celery.result import AsyncResult

from celery_redlock.core.exceptions import DuplicateSkipped

__all__ = ["SKIPPED", "SingletonResult", "skipped_error"]

#: Task state recorded for a call skipped because a duplicate held the lock.
#: Not a Celery ready state: :meth:`SingletonResult.get` raises
#: :class:`~celery_redlock.DuplicateSkipped` for it.
SKIPPED = "SKIPPED"

# The first wait for a ready state, doubled up to the last: a skip is usually
# recorded within milliseconds of the publish, a real result may take minutes.
_FIRST_WAIT = 0.05
_LONGEST_WAIT = 1.0


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
    """An ``AsyncResult`` whose :meth:`get` returns promptly for a skipped duplicate."""

    def get(
        self,
        timeout: float | None = None,
        propagate: bool = True,
        interval: float = 0.5,
        **options: Any,
    ) -> Any:
        """Wait for the result as ``AsyncResult.get`` does; a ``SKIPPED`` call ends the wait.

        Raises:
            DuplicateSkipped: The call was skipped (with ``propagate``; without,
                the error is returned).
            celery.exceptions.TimeoutError: Nothing ready within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = _FIRST_WAIT
        while True:
            if self.state == SKIPPED:
                error = skipped_error(self.id, self.info)
                if propagate:
                    raise error
                return error
            left = None if deadline is None else deadline - time.monotonic()
            step = wait if left is None else max(0.0, min(wait, left))
            try:
                return super().get(
                    timeout=step, propagate=propagate, interval=min(interval, step), **options
                )
            except ResultTimeout:
                if left is not None and left <= step:
                    raise
            wait = min(wait * 2, _LONGEST_WAIT)
