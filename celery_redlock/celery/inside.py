"""Which task's guarded run the current thread (or greenlet) is inside.

A task that calls a task directly runs it as a function within its own run;
the guard must not lock that call again. :func:`guarding` marks the run,
:func:`called_inside` tells such a call apart.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

__all__ = ["called_inside", "enter", "guarding", "leave"]

# The id of the task whose call runs under a guard in this thread (or greenlet).
_guarded_task_id: ContextVar[str | None] = ContextVar("celery_redlock_guarded_task", default=None)


class _Guarding:
    """The ``with`` block of :func:`guarding`: a class, not a generator (it wraps every task)."""

    __slots__ = ("task_id", "token")

    def __init__(self, task_id: str | None) -> None:
        self.task_id = task_id

    def __enter__(self) -> None:
        self.token = _guarded_task_id.set(self.task_id)

    def __exit__(self, *exc_info: object) -> None:
        _guarded_task_id.reset(self.token)


def guarding(request: Any) -> _Guarding:
    """Mark the task of ``request`` as running under its lock in this context."""
    return _Guarding(request.id)


def enter(request: Any) -> Token[str | None]:
    """:func:`guarding` without the ``with`` block: mark the run until :func:`leave`."""
    return _guarded_task_id.set(request.id)


def leave(token: Token[str | None]) -> None:
    """End the mark that :func:`enter` returned ``token`` for."""
    _guarded_task_id.reset(token)


def called_inside(request: Any) -> bool:
    """Whether a call made now is a direct call inside the body of its own guarded run.

    A task calling a task directly (``other(...)``, or itself) runs it as a
    function within the same task: it must not take a lock of its own, and
    above all not meet the lock of the run it is part of. Celery runs such a
    call under a copy of the running request (same id), pushed on the stack,
    so the id is what tells it apart; an eager ``apply()`` gets a new id and
    is locked as usual.
    """
    task_id = request.id
    return task_id is not None and _guarded_task_id.get() == task_id
