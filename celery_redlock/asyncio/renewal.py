"""Auto-renewal of an asyncio lease: one task per lease on the lock's event loop.

The task sleeps a third of the TTL, renews the lease to its full TTL with the
lease's ``renew_script`` (``RENEW``; ``RENEW_PERMITS`` for a semaphore permit),
and repeats until the lease is released, lost, or its lock object
garbage-collected. As with the thread watchdog, a renewal that fails on a
connection error or a timeout is retried until the lease's validity deadline
and only then given up as lost; a lease the server no longer holds for us is
lost at once. Either way ``Lease.lost`` turns true, ``on_lost`` is called and an
ERROR line names the key and fence. Each round trip is bounded, so a hung server
cannot hold the task past the lease's validity.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Callable

from redis.exceptions import RedisError

from celery_redlock.core.error_text import describe_error
from celery_redlock.core.lease import Lease

from .scripts import run_script

__all__ = ["RENEWAL_TIMEOUT", "Renewer", "keep_alive", "renew_on"]

#: Renews a lease to ``ms`` milliseconds; gives the new TTL in ms, 0 if not ours.
Renewer = Callable[[Lease, int], Awaitable[int]]

logger = logging.getLogger(__name__)

#: Longest one renewal round trip may take, in seconds.
RENEWAL_TIMEOUT = 1.0


def _retry_delay(ttl: float) -> float:
    # Several attempts fit into the third of a TTL that is left.
    return min(1.0, max(0.05, ttl / 10))


def renew_on(client: Any) -> Renewer:
    """The renewer of leases on one server, through ``client``."""

    async def renew(lease: Lease, ms: int) -> int:
        # A lock's lease renews with RENEW, a semaphore permit's with its own script.
        (pttl_ms,) = await run_script(
            lease.renew_script, client, (lease.renew_key,), ("1", lease.token, ms)
        )
        return int(pttl_ms)

    return renew


async def keep_alive(lease: Lease, renew: Renewer, clock: Any) -> None:
    """Renew ``lease`` with ``renew`` every third of its TTL until it ends.

    Run it as a task; cancel the task to stop renewing (release does). The
    renewer must not hold the lock object, whose collection ends the renewals.
    """
    ttl = lease.ttl
    assert ttl is not None
    ttl_ms = int(ttl * 1000)
    due = clock() + ttl / 3
    while True:
        await asyncio.sleep(max(0.0, due - clock()))
        if not lease.still_to_renew():
            return
        sent_at = clock()
        try:
            pttl_ms = await asyncio.wait_for(renew(lease, ttl_ms), RENEWAL_TIMEOUT)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            if lease.released:
                return
            left = lease.remaining()
            if left <= 0.0:
                lease.mark_lost(f"validity expired while renewal failed ({describe_error(exc)})")
                return
            logger.warning(
                "%s: renewal failed (%s); retrying", lease.describe(), describe_error(exc)
            )
            due = clock() + min(_retry_delay(ttl), left)
            continue
        if lease.released:
            return
        if not pttl_ms:
            lease.mark_lost("the key no longer holds this lease's token")
            return
        lease.validate_until(sent_at, pttl_ms / 1000)
        lease.renewals += 1
        due = sent_at + ttl / 3
