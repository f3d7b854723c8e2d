"""Per-queue locking: which queues a worker locks, and the wrapper that locks plain tasks.

A message does not say which queue it was consumed from; its delivery carries
the exchange and routing key. :class:`QueueLocks` maps those back to the
worker's consumed queues (``exchange ''`` routes by queue name), and refuses
at worker start a setup where one route leads to a locked and an unlocked
queue, since no call could then tell which it came from.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from .conf import GUARDED_ATTRIBUTE, resolve
from .exceptions import ConfigurationError
from .guard import called_inside, guard_for, guarding

__all__ = [
    "QueueLocks",
    "check_guarded_tasks",
    "lock_plain_tasks",
    "locked_queue",
    "register",
    "registered",
]


class QueueLocks:
    """The locked queues of one worker and how to recognise their deliveries.

    Args:
        locked: Locked queue name -> its options (from ``redlock_queues`` and
            the worker option).
        consumed: The ``kombu.Queue`` objects the worker consumes from.

    Raises:
        ConfigurationError: If a locked and an unlocked consumed queue share a
            route (exchange and routing key).
    """

    def __init__(self, locked: Mapping[str, Mapping[str, Any]], consumed: Iterable[Any]) -> None:
        self.locked = {name: dict(options) for name, options in locked.items()}
        self._routes: dict[tuple[str, str], str] = {}
        unlocked_routes: dict[tuple[str, str], str] = {}
        for queue in consumed:
            exchange = queue.exchange.name if queue.exchange is not None else ""
            kind = queue.exchange.type if queue.exchange is not None else "direct"
            if queue.name in self.locked and exchange and kind != "direct":
                # Topic, fanout and headers routes do not name one queue: a call
                # could not tell whether it came from the locked one.
                raise ConfigurationError(
                    "redlock_queues",
                    queue.name,
                    f"is bound to {kind} exchange {exchange!r}; per-queue locking needs "
                    "direct routing (lock the tasks with SingletonTask instead)",
                )
            routes = {("", queue.name), (exchange or "", queue.routing_key or queue.name)}
            target = self._routes if queue.name in self.locked else unlocked_routes
            for route in routes:
                target.setdefault(route, queue.name)
        clashes = sorted(set(self._routes) & set(unlocked_routes))
        if clashes:
            exchange, routing_key = clashes[0]
            raise ConfigurationError(
                "redlock_queues",
                sorted(self.locked),
                f"locked queue {self._routes[clashes[0]]!r} and unlocked queue "
                f"{unlocked_routes[clashes[0]]!r} share exchange {exchange!r} and "
                f"routing key {routing_key!r}: a delivery cannot tell them apart",
            )

    def queue_of(self, delivery_info: Mapping[str, Any] | None) -> str | None:
        """Return the locked queue a delivery came from, or ``None``."""
        if not delivery_info:
            return None
        route = (delivery_info.get("exchange") or "", delivery_info.get("routing_key") or "")
        return self._routes.get(route)


_registry: weakref.WeakKeyDictionary[Any, QueueLocks] = weakref.WeakKeyDictionary()


def register(app: Any, locks: QueueLocks) -> None:
    """Make ``locks`` the queue locks of ``app`` in this process (and its forks)."""
    _registry[app] = locks


def registered(app: Any) -> QueueLocks | None:
    """Return the queue locks of ``app`` in this process, if its worker set them up."""
    return _registry.get(app)


def locked_queue(task: Any) -> tuple[str, Mapping[str, Any]] | None:
    """Return (queue, options) if the running call of ``task`` came from a locked queue."""
    locks = _registry.get(task.app)
    if locks is None:
        return None
    queue = locks.queue_of(task.request.delivery_info)
    if queue is None:
        return None
    return queue, locks.locked[queue]


def lock_plain_tasks(app: Any) -> int:
    """Wrap the body of every plain task of ``app`` so calls from locked queues take the lock.

    Celery's own tasks and tasks that lock themselves are left alone. Runs at
    worker start, before the pool builds its tracers (which capture ``run``).
    Returns how many tasks were wrapped.
    """
    wrapped = 0
    for name, task in list(app.tasks.items()):
        if name.startswith("celery.") or getattr(task, GUARDED_ATTRIBUTE, False):
            continue
        if getattr(task.run, GUARDED_ATTRIBUTE, False):
            continue
        task.run = _guarded(task, task.run)
        wrapped += 1
    return wrapped


def check_guarded_tasks(app: Any, locks: QueueLocks) -> None:
    """Resolve each task's options for each locked queue, at worker start.

    Every task a locked queue could deliver is checked, ``SingletonTask`` s and
    plain tasks alike: a queue entry that cannot apply to one of them, or a
    task attribute that cannot apply to a plain task (see
    :func:`celery_redlock.conf.resolve`), then stops the worker before a
    message is taken, not at the first call from that queue. (A queue entry's
    ``key`` is checked against a task's arguments at its first call from that
    queue: which tasks a queue receives is the routing's business.)

    Raises:
        ConfigurationError: Naming the queue entry's option, or the task attribute, at fault.
    """
    for name, task in list(app.tasks.items()):
        if name.startswith("celery."):
            continue
        for queue, options in locks.locked.items():
            resolve(task, app.conf, queue, options)


def _guarded(task: Any, body: Any) -> Any:
    # functools.wraps sets __wrapped__, so the lock key binds arguments to the
    # original signature.
    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        request = task.request
        found = None if called_inside(request) else locked_queue(task)
        if found is None:
            return body(*args, **kwargs)
        queue, options = found
        with guarding(request):
            return guard_for(task, queue, options).run(args, kwargs, lambda: body(*args, **kwargs))

    setattr(run, GUARDED_ATTRIBUTE, True)
    return run
