"""Signals sent by celery-redlock, in Celery's own signal style.

Connect with ``@lock_acquired.connect`` like any Celery signal. The sender is
the task; every signal carries ``task_id`` and ``key``. Receivers run in the
process that runs the task (the pool child under prefork); a receiver that
raises is logged by Celery and does not affect the task.

The worker's own counters are not receivers of these signals: the guard feeds
them directly (:mod:`celery_redlock.celery.events`) and sends a signal only
while a receiver is connected.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_contended", "lock_lapsed", "lock_lost", "lock_released"]

# The two signals every task sends look their receivers up once per sender
# (Celery's use_caching; the cache is cleared on connect and disconnect), not on
# every send: the sender is always a task, which weak references can name.

#: The task took its lock. Also sends ``fence``, ``ttl`` and ``waited``: seconds
#: since the call first joined its key's wait line, or ``None`` if it never waited.
lock_acquired = Signal(
    name="lock_acquired",
    providing_args={"task_id", "key", "fence", "ttl", "waited"},
    use_caching=True,
)

#: Another call holds the lock. ``action`` is what the task does about it
#: (``"skip"``, ``"requeue"``, ``"raise"``, or ``"requeue"`` for a redelivered
#: copy meeting its own lock); ``holder`` is the holder's task id, if known;
#: ``line`` how many wait in the key's line when the call waits in it, else ``None``.
lock_contended = Signal(
    name="lock_contended",
    providing_args={"task_id", "key", "holder", "action", "attempt", "line"},
)

#: The task released its lock; ``owned`` is False if it had been lost first.
lock_released = Signal(
    name="lock_released", providing_args={"task_id", "key", "fence", "owned"}, use_caching=True
)

#: The lock was lost while the task ran (expired, stolen, or Redis failed for
#: longer than the TTL). Sent from the watchdog thread; ``reason`` says why.
lock_lost = Signal(name="lock_lost", providing_args={"task_id", "key", "fence", "reason"})

#: A task's enqueue lock expired before a worker started the task (a queue
#: backlog longer than ``lock_enqueue_ttl``). The task still runs; ``key`` is
#: the reservation key and ``mode`` the task's lock mode.
lock_lapsed = Signal(name="lock_lapsed", providing_args={"task_id", "key", "mode"})
