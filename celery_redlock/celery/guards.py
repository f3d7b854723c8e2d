"""Which guard runs a task's calls: one per task, queue and process, built on first use."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from celery_redlock.calls.windows import keeps_newest
from celery_redlock.celery.settings import resolve
from celery_redlock.core.store import store_for

from .guard import TaskGuard
from .newest import NewestGuard
from .window import EnqueueGuard

__all__ = ["guard_for"]

# A weak reference to a task -> its guards by queue, which go with the task.
# Looked up with weakref.ref(task) (a reference hashes and compares as its
# task does), not WeakKeyDictionary.get, a Python call on every task's path.
_guards: dict[weakref.ref[Any], dict[str | None, TaskGuard]] = {}


def _forget_task(ref: weakref.ref[Any]) -> None:
    _guards.pop(ref, None)


def guard_for(
    task: Any, queue: str | None = None, queue_options: Mapping[str, Any] | None = None
) -> TaskGuard:
    """Return the guard of ``task`` for calls from ``queue``, built on first use in this process.

    Args:
        task: The task.
        queue: The locked queue the call came from, if any.
        queue_options: That queue's entry of ``redlock_queues``.
    """
    per_queue = _guards.get(weakref.ref(task))
    if per_queue is None:
        per_queue = _guards[weakref.ref(task, _forget_task)] = {}
    guard = per_queue.get(queue)
    if guard is None:
        options = resolve(task, task.app.conf, queue, queue_options)
        factory: type[TaskGuard] = EnqueueGuard
        if options.mode == "while_executing":
            factory = TaskGuard
        elif keeps_newest(options):
            factory = NewestGuard
        guard = per_queue[queue] = factory(task, options, store_for(task.app), queue)
    return guard
