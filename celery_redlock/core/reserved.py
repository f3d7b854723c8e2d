"""The connection each redis-py pool keeps checked out for the lock's scripts.

Checking a connection out of a redis-py pool and back in costs more client
CPU than the script call itself (locks, a readiness poll, metrics), twice per
task. A prefork child runs one task at a time, so one connection it keeps
serves nearly every call; a call that finds it busy (another thread, the
watchdog) uses the pool as before.

A connection is only reserved from a pool that can spare one for good: one
whose ``max_connections`` is at least :data:`RESERVE_FROM_POOLS_OF` and that
is not a ``BlockingConnectionPool``. Any other pool is used per call: a
connection kept out of a small pool is one that the application's own
commands fail without (``MaxConnectionsError`` with ``max_connections=1``),
and a blocking pool would make them wait for it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from redis.connection import BlockingConnectionPool

from .forks import in_forked_children

__all__ = ["RESERVE_FROM_POOLS_OF", "Reserved", "checkout", "drop_connections", "reserved_for"]


def checkout(pool: Any) -> Any:
    """Check a connection out of ``pool``, whatever the redis-py version."""
    # redis-py >= 5.3 takes no arguments (and warns about them); older versions
    # require the command name.
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("EVALSHA")


class Reserved:
    """The connection one pool keeps for this process, and who is using it now.

    Attributes:
        busy: Held while a call uses the connection; a call that cannot take
            it at once uses the pool instead.
        connection: The connection, checked out on first use; ``None`` before.
    """

    __slots__ = ("busy", "connection")

    def __init__(self) -> None:
        self.busy = threading.Lock()
        self.connection: Any = None


#: Smallest ``max_connections`` of a pool that a connection is reserved from:
#: redis-py's default bound (100 in redis-py 8, ``2**31`` in older versions),
#: so default clients keep the fast path and a pool sized by hand to a few
#: connections keeps all of them for the application.
RESERVE_FROM_POOLS_OF = 100

# A weak reference to a pool -> its reservation, which goes with the pool. A
# WeakKeyDictionary would do, but its get() is a Python call, two per task:
# a weak reference hashes and compares as its pool does, so one is looked up
# with weakref.ref(pool), which returns the pool's existing plain reference.
_reserved: dict[weakref.ref[Any], Reserved] = {}


def _forget_reserved() -> None:
    # A forked child must not use its parent's sockets; redis-py resets the
    # pools themselves when the child first uses them.
    _reserved.clear()


def _forget_pool(ref: weakref.ref[Any]) -> None:
    _reserved.pop(ref, None)


def reserved_for(pool: Any) -> Reserved | None:
    """Return the reservation of ``pool`` in this process; ``None`` if it cannot spare one."""
    # Every script call asks: a pool that has its reservation answers first.
    reserved = _reserved.get(weakref.ref(pool))
    if reserved is not None:
        return reserved
    if isinstance(pool, BlockingConnectionPool):
        return None
    max_connections = getattr(pool, "max_connections", None)
    if not isinstance(max_connections, int) or max_connections < RESERVE_FROM_POOLS_OF:
        return None
    # The fork hook comes first, so every reservation has one to forget it.
    in_forked_children(_forget_reserved)
    return _reserved.setdefault(weakref.ref(pool, _forget_pool), Reserved())


def drop_connections(client: Any) -> None:
    """Close ``client``'s idle connections, the one kept checked out included.

    Each reconnects on its next use: a Sentinel client then asks the Sentinels
    for the current master instead of writing on to the one it knew.
    """
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return
    reserved = _reserved.get(weakref.ref(pool))
    if reserved is not None and reserved.busy.acquire(blocking=False):
        try:
            if reserved.connection is not None:
                reserved.connection.disconnect()
        finally:
            reserved.busy.release()
    pool.disconnect(inuse_connections=False)
