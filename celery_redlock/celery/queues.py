"""Per-queue locking: which queues a worker locks, and the wrapper that locks plain tasks.

A message does not say which queue it was consumed from; its delivery carries
the exchange and routing key. :class:`QueueLocks` maps those back to the
worker's locked queues (``exchange ''`` routes by queue name), and refuses
at worker start a setup where one route leads to a locked and an unlocked
queue, since no call could then tell which it came from. The same map covers
the locked queues the worker does not consume at start but may be told to
(``add_consumer``): pool processes never hear of such an addition, so what
they need is fixed at start, and the main process refuses an addition whose
deliveries they could not tell apart (:meth:`QueueLocks.refusal`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from celery_redlock.celery.settings import (
    GUARDED_ATTRIBUTE,
    check_settings,
    parse_queues,
    resolve,
)
from celery_redlock.core.exceptions import ConfigurationError

from .guards import guard_for
from .inside import called_inside, guarding

__all__ = [
    "QueueLocks",
    "check_guarded_tasks",
    "lock_plain_tasks",
    "lock_queues",
    "locked_queue",
    "register",
    "registered",
]

Route = tuple[str, str]


def _binding(queue: Any) -> tuple[str, str, set[Route]]:
    """Return the exchange name and type of ``queue`` and the routes of its deliveries."""
    exchange = queue.exchange.name if queue.exchange is not None else ""
    kind = queue.exchange.type if queue.exchange is not None else "direct"
    routes = {("", queue.name), (exchange or "", queue.routing_key or queue.name)}
    return exchange, kind, routes


def _describe(route: Route) -> str:
    return f"exchange {route[0]!r} and routing key {route[1]!r}"


class QueueLocks:
    """The locked queues of one worker and how to recognise their deliveries.

    Args:
        locked: Locked queue name -> its options (from ``redlock_queues`` and
            the worker option), whether the worker consumes it at start or not.
        consumed: The ``kombu.Queue`` objects the worker consumes from at start.
        declared: The app's ``kombu.Queue`` objects (``app.amqp.queues``): a
            locked queue the worker does not consume at start is expected with
            its declared binding if it has one, otherwise with the one
            ``add_consumer`` gives a queue by default (a direct exchange and a
            routing key both named after it).

    Raises:
        ConfigurationError: If a locked and an unlocked consumed queue share a
            route (exchange and routing key), or a consumed locked queue is not
            bound to a direct exchange.
    """

    def __init__(
        self,
        locked: Mapping[str, Mapping[str, Any]],
        consumed: Iterable[Any],
        declared: Iterable[Any] = (),
    ) -> None:
        self.locked = {name: dict(options) for name, options in locked.items()}
        consumed = list(consumed)
        #: The locked queues the worker consumed at start.
        self.consumed = frozenset(q.name for q in consumed if q.name in self.locked)
        self._routes: dict[Route, str] = {}
        self._unlocked_routes: dict[Route, str] = {}
        for queue in consumed:
            exchange, kind, routes = _binding(queue)
            if queue.name in self.locked and exchange and kind != "direct":
                # Topic, fanout and headers routes do not name one queue: a call
                # could not tell whether it came from the locked one.
                raise ConfigurationError(
                    "redlock_queues",
                    queue.name,
                    f"is bound to {kind} exchange {exchange!r}; per-queue locking needs "
                    "direct routing (lock the tasks with SingletonTask instead)",
                )
            target = self._routes if queue.name in self.locked else self._unlocked_routes
            for route in routes:
                target.setdefault(route, queue.name)
        clashes = sorted(set(self._routes) & set(self._unlocked_routes))
        if clashes:
            exchange, routing_key = clashes[0]
            raise ConfigurationError(
                "redlock_queues",
                sorted(self.locked),
                f"locked queue {self._routes[clashes[0]]!r} and unlocked queue "
                f"{self._unlocked_routes[clashes[0]]!r} share exchange {exchange!r} and "
                f"routing key {routing_key!r}: a delivery cannot tell them apart",
            )
        bindings = {queue.name: queue for queue in declared}
        for name in sorted(self.locked.keys() - self.consumed):
            queue = bindings.get(name)
            if queue is None:
                exchange, kind, routes = name, "direct", {("", name), (name, name)}
            else:
                exchange, kind, routes = _binding(queue)
            if exchange and kind != "direct":
                # Only the anonymous exchange's route names this queue alone;
                # an addition of it is refused (see refusal()).
                routes = {("", name)}
            for route in routes:
                # A route an unlocked queue consumed at start already takes is
                # left out: the queue cannot be added (see refusal()).
                if route not in self._unlocked_routes:
                    self._routes.setdefault(route, name)

    def queue_of(self, delivery_info: Mapping[str, Any] | None) -> str | None:
        """Return the locked queue a delivery came from, or ``None``."""
        if not delivery_info:
            return None
        route = (delivery_info.get("exchange") or "", delivery_info.get("routing_key") or "")
        return self._routes.get(route)

    def refusal(self, queue: Any) -> str | None:
        """Say why the worker must not start consuming ``queue`` at runtime, or return ``None``.

        The pool processes recognise deliveries by the routes this object
        computed at worker start, and never learn of a queue added later. So a
        locked queue can be added only on routes that map knows as locked, and
        an unlocked queue only on routes that lead to no locked queue (its
        tasks would otherwise be locked as that queue's).
        """
        exchange, kind, routes = _binding(queue)
        if queue.name in self.locked:
            if exchange and kind != "direct":
                return (
                    f"it is bound to {kind} exchange {exchange!r}; per-queue locking "
                    "needs direct routing"
                )
            for route in sorted(routes):
                if route in self._routes:
                    # Locked, under the options of the queue the route leads to
                    # (two locked queues sharing a route are allowed at start).
                    continue
                owner = self._unlocked_routes.get(route)
                if owner is not None:
                    return (
                        f"unlocked queue {owner!r}, consumed at worker start, has the same "
                        f"{_describe(route)}: a delivery cannot tell them apart"
                    )
                return (
                    f"its pool processes were started knowing no locked queue with "
                    f"{_describe(route)}: declare the queue in task_queues, or add it "
                    "without an exchange or routing key"
                )
            return None
        for route in sorted(routes):
            owner = self._routes.get(route)
            if owner is not None:
                return (
                    f"locked queue {owner!r} has the same {_describe(route)}: "
                    "a delivery cannot tell them apart"
                )
        return None


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


def lock_queues(
    app: Any, cli_queues: str | None, consumed: Mapping[str, Any]
) -> tuple[QueueLocks, int]:
    """Validate every redlock setting and set up per-queue locking in this process.

    Runs in the worker's main process (through
    :func:`~celery_redlock.celery.bootsteps.prepare_worker`), and again in
    each spawned pool process (see :mod:`celery_redlock.celery.spawned`).

    Args:
        app: The worker's app.
        cli_queues: The ``--redlock-queues`` value, if given.
        consumed: The queues this worker consumes, by name.

    Returns:
        The queue locks, and how many plain tasks were wrapped.

    Raises:
        ConfigurationError: Naming the first bad setting, option or queue.
    """
    queues = check_settings(app.conf)
    for name in parse_queues(cli_queues, "--redlock-queues"):
        if name not in consumed:
            raise ConfigurationError(
                "--redlock-queues",
                name,
                f"is not a queue this worker consumes ({', '.join(sorted(consumed))})",
            )
        queues.setdefault(name, {})
    # Every locked queue, consumed or not: the worker may be told to consume one
    # later (add_consumer), and its pool processes must already know it then.
    locks = QueueLocks(queues, consumed.values(), app.amqp.queues.values())
    check_guarded_tasks(app, locks, sorted(locks.consumed))
    register(app, locks)
    return locks, lock_plain_tasks(app) if locks.locked else 0


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
        task.run = _guarded(app, task, task.run)
        wrapped += 1
    return wrapped


def check_guarded_tasks(app: Any, locks: QueueLocks, queues: Iterable[str] | None = None) -> None:
    """Resolve each task's options for each locked queue (or only ``queues``).

    Runs at worker start for the locked queues the worker consumes, and for a
    locked queue when the worker is told to consume it later.

    Every task a locked queue could deliver is checked, ``SingletonTask`` s and
    plain tasks alike: a queue entry that cannot apply to one of them, or a
    task attribute that cannot apply to a plain task (see
    :func:`celery_redlock.calls.options.resolve`), then stops the worker (or refuses
    to add the queue) before a message is taken, not at the first call from
    that queue. (A queue entry's
    ``key`` is checked against a task's arguments at its first call from that
    queue: which tasks a queue receives is the routing's business.)

    Raises:
        ConfigurationError: Naming the queue entry's option, or the task attribute, at fault.
    """
    for name, task in list(app.tasks.items()):
        if name.startswith("celery."):
            continue
        for queue in locks.locked if queues is None else queues:
            resolve(task, app.conf, queue, locks.locked[queue])


def _guarded(app: Any, task: Any, body: Any) -> Any:
    # functools.wraps sets __wrapped__, so the lock key binds arguments to the
    # original signature.
    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Every call of a plain task passes here, from locked queues or not:
        # one read of task.request (a slow property, as is task.app) and dict
        # lookups until the call turns out to come from a locked queue.
        request = task.request
        locks = _registry.get(app)
        queue = None if locks is None else locks.queue_of(request.delivery_info)
        if locks is None or queue is None or called_inside(request):
            return body(*args, **kwargs)
        with guarding(request):
            return guard_for(task, queue, locks.locked[queue]).run(
                args, kwargs, lambda: body(*args, **kwargs)
            )

    setattr(run, GUARDED_ATTRIBUTE, True)
    return run
