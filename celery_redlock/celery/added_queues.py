"""Queues a worker is told to consume at runtime: checked before the worker consumes them.

Celery's ``add_consumer`` remote-control command (``celery control
add_consumer``, ``app.control.add_consumer``) makes the worker's main process
consume one more queue through ``Consumer.add_task_queue``. Nothing tells the
pool processes: forked or spawned before, they run the new queue's tasks
knowing only what :class:`~celery_redlock.celery.queues.QueueLocks` computed at
worker start. That is enough, because it already maps the routes of every
locked queue, consumed or not (with Celery's default routing a delivery's
route is the anonymous exchange and the queue's name, which needs no more).

What remains is a queue added on a route the pool processes cannot map back:
a locked queue bound elsewhere than the start-up map expects, or an unlocked
queue on the route of a locked one. :class:`AddedQueuesStep` checks each
addition in the main process before the queue is consumed (a delivery may
reach the pool as soon as it is) and refuses one of those with an ERROR, as a
worker would refuse to start with them; the remote-control reply, sent
before the addition runs, cannot say so.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery import bootsteps

from celery_redlock.core.exceptions import ConfigurationError

from .queues import QueueLocks, check_guarded_tasks, registered

__all__ = ["AddedQueuesStep", "queue_to_add", "refusal"]

logger = logging.getLogger(__name__)

_CHECKED_ATTRIBUTE = "__celery_redlock_checked__"


def queue_to_add(
    app: Any,
    name: str,
    exchange: str | None = None,
    exchange_type: str | None = None,
    routing_key: str | None = None,
    **options: Any,
) -> Any:
    """Return the ``kombu.Queue`` that ``Consumer.add_task_queue`` will consume for these arguments.

    As Celery 5 does, a queue the app already has (declared, or added before)
    is used as it is, whatever the arguments say; another one is built from
    the arguments with the app's defaults, on a scratch copy of the app's
    queue table so that a refused queue leaves no trace.
    """
    queues = app.amqp.queues
    if name in queues:  # ``in``, as Celery: ``queues[name]`` would create it
        return queues[name]
    return app.amqp.Queues([]).add(
        name,
        exchange=name if exchange is None else exchange,
        exchange_type="direct" if exchange_type is None else exchange_type,
        routing_key=routing_key,
        **options,
    )


def refusal(app: Any, locks: QueueLocks, queue: Any) -> str | None:
    """Say why the worker must not start consuming ``queue``, or return ``None``.

    Besides the routes (:meth:`~celery_redlock.celery.queues.QueueLocks.refusal`), a
    locked queue's entry must apply to every task, as at worker start.
    """
    reason = locks.refusal(queue)
    if reason is None and queue.name in locks.locked:
        try:
            check_guarded_tasks(app, locks, [queue.name])
        except ConfigurationError as exc:
            reason = str(exc)
    return reason


def _checked(consumer: Any, locks: QueueLocks, add: Any) -> Any:
    @functools.wraps(add)
    def add_task_queue(
        queue: str,
        exchange: str | None = None,
        exchange_type: str | None = None,
        routing_key: str | None = None,
        **options: Any,
    ) -> Any:
        app = consumer.app
        reason = refusal(
            app, locks, queue_to_add(app, queue, exchange, exchange_type, routing_key, **options)
        )
        if reason is not None:
            logger.error("celery-redlock: not consuming from queue %r: %s", queue, reason)
            return None
        result = add(queue, exchange, exchange_type, routing_key, **options)
        added = app.amqp.queues.consume_from.get(queue)
        late = None if added is None else refusal(app, locks, added)
        if late is not None:
            # Only if Celery built the queue otherwise than queue_to_add foresaw.
            logger.error("celery-redlock: no longer consuming from queue %r: %s", queue, late)
            consumer.cancel_task_queue(queue)
        elif queue in locks.locked:
            logger.info("celery-redlock: locking tasks from queue %s (added)", queue)
        return result

    setattr(add_task_queue, _CHECKED_ATTRIBUTE, True)
    return add_task_queue


class AddedQueuesStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery ships no type hints
    """Consumer bootstep that checks each queue the worker is told to consume at runtime.

    Added by :func:`celery_redlock.celery.install`. It replaces the consumer's
    ``add_task_queue`` (which the ``add_consumer`` command calls) by a checked
    one, and only on a worker with locked queues: others pay nothing.
    """

    name = "celery-redlock-added-queues"

    def start(self, parent: Any) -> None:
        """Check the queues ``parent`` (the consumer) is told to add, if any queue is locked."""
        locks = registered(parent.app)
        if locks is None or not locks.locked:
            return
        # start() runs again after a lost broker connection: check once.
        if not getattr(parent.add_task_queue, _CHECKED_ATTRIBUTE, False):
            parent.add_task_queue = _checked(parent, locks, parent.add_task_queue)
