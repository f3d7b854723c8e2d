"""Each thread's own connection to a Redlock master, kept from one operation to the next.

Internal to :mod:`celery_redlock.core.fanout`, which sends on a thread's lanes
and reads their replies; :class:`~celery_redlock.core.nodes.Node` keeps one
lane per thread and drops them all in a forked child.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["HandBack", "Lane", "ThreadLane", "change", "changed", "weak_hand_back"]

#: ``hand_back(connection, replies owed, when to give up on them)``.
HandBack = Callable[[Any, int, float], None]

_changes = itertools.count(1)
#: Changes whenever a master's connections fail or it forgets a script, in any
#: thread; a thread's :class:`~celery_redlock.core.volley.Volley` made before
#: is then made again (its checks were done once, for as long as this holds).
change = 0


def changed() -> None:
    """Record that a master failed or forgot a script (call after changing its state).

    Each call stores a value never stored before (``next()`` of a counter is
    atomic, and so is the assignment), so two threads that race here cannot
    leave ``change`` at a value a volley took before either call.
    """
    global change
    change = next(_changes)


def weak_hand_back(method: Callable[..., None], *leading: Any) -> HandBack:
    """A lane's hand-back that calls ``method(*leading, conn, owed, give_up)``, held weakly.

    ``method`` is bound to the lanes' owner (a master's node). Held strongly
    it would make a cycle (the owner, its thread-local lanes, a lane, the
    method, the owner) with a ``__del__`` in it, which only the cyclic
    collector breaks, in two passes: an owner made for a short-lived client
    would keep a connection per thread open until then. Held weakly, the
    owner goes with its client, and the lanes' connections are closed at once.
    """
    owner_method = weakref.WeakMethod(method)

    def hand_back(conn: Any, owed: int, give_up: float) -> None:
        bound = owner_method()
        if bound is None:
            conn.disconnect()  # its pool went with the owner
            return
        bound(*leading, conn, owed, give_up)

    return hand_back


class Lane:
    """One thread's connection to one master, kept from one operation to the next.

    A thread runs one round at a time, so the connection needs no lock, and
    replies nobody waited for are counted (``owed``) and read before the next
    reply instead of the connection going back to a shared pool: no check-out,
    check-in or parking per operation. The round that sends on the lane marks
    it ``busy`` until its reply is read; a round the same thread starts
    meanwhile (a second vote before the first one is finished) takes another
    connection. Replies owed for longer than the node timeout close the
    connection (``give_up``), as for a parked one; so does a failure of the
    master that any thread met since the connection was taken (``epoch``): after
    a restart, each thread's connection would otherwise fail on its first use,
    and a request resent after a lost reply is not always the same request.
    """

    __slots__ = ("busy", "conn", "epoch", "give_up", "hand_back", "owed")

    def __init__(self, hand_back: HandBack | None = None) -> None:
        # Called with the connection when the thread ends (see __del__).
        self.hand_back = hand_back
        self.conn: Any = None
        # The master's failure count when the connection was taken: a failure
        # another thread met since (a restart) makes it stale.
        self.epoch = 0
        self.owed = 0
        self.give_up = 0.0
        self.busy = False

    def take(self, conn: Any, epoch: int) -> None:
        """Keep ``conn``, which has nothing left to read, for the thread's next rounds."""
        self.conn, self.epoch, self.owed, self.busy = conn, epoch, 0, False

    def drop(self, conn: Any) -> None:
        """Forget ``conn`` if it is the lane's (it failed, or went to the shared pool)."""
        if self.conn is conn:
            self.conn = None
            self.owed = 0
            self.busy = False

    def __del__(self) -> None:
        # A lane goes when its thread ends (or its greenlet: a gevent pool runs
        # each task in a new one). Its connection goes back to the master's
        # shared pool, so that the next thread does not connect again.
        conn, hand_back = self.conn, self.hand_back
        if conn is not None and hand_back is not None and not self.busy:
            hand_back(conn, self.owed, self.give_up)


class ThreadLane(threading.local):
    """A thread's lane to one master (``None`` until the thread first asks it)."""

    # Class attributes are the per-thread defaults of a threading.local subclass.
    lane: Lane | None = None
