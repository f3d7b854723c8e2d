"""The order of the asyncio Redlock's requests: one queue per lock key and client.

A master runs one connection's commands in order but may interleave two
connections' any way, so each request for a key through a client waits for
the one before it (see :mod:`celery_redlock.asyncio.redlock` for why, and
for what escapes it). The queue is bounded: a master that stops answering a
key ties up a few requests for it, not one per operation.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

__all__ = ["MAX_PENDING", "Claim", "KeyQueue", "queues_of"]

#: Requests for one lock key that one master may have pending (sent or waiting
#: their turn) before further ones fail at once, as that master's failure; a
#: release the key's queue owes is queued all the same (see :class:`KeyQueue`).
MAX_PENDING = 16


class Claim:
    """What one acquire queued on a master may have stored, as its release sees it.

    ``stored`` turns ``False`` once the acquire is known to have stored
    nothing there: it was refused, or never written (``NotSent``).
    """

    __slots__ = ("stored", "value")

    def __init__(self, value: bytes) -> None:
        self.value = value
        self.stored = True


class KeyQueue:
    """The requests for one lock key through one client, which its master runs in order.

    Each request is sent once the one before it has answered or failed. While
    the request at the head has gone unanswered for the node timeout, or
    ``MAX_PENDING`` requests are pending, a new request is not queued: it fails
    at once. So a hung master ties up a few requests per key, not one per
    operation for as long as it hangs.

    Releases are exempt, within limits that keep the queue bounded: an acquire
    queued here records its value as owed a release, and the first release of
    that value is queued however long the queue, behind its acquire. A
    release of a value not owed is not sent, and answers 0 (not deleted) at
    once: its acquire never went out here (it failed at once, or its
    connection could not be opened: ``NotSent``), was refused here (the key
    held another value), or a release of it is queued already. A release
    queued behind an acquire that then turns out never sent or refused
    answers 0 the same way, unsent.
    """

    __slots__ = ("head_since", "loop", "owed", "pending", "tail")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.tail: asyncio.Task[Any] | None = None
        self.pending = 0
        # Loop time when the request now at the head became the head.
        self.head_since = loop.time()
        # Values an acquire queued here may have stored, with no release queued
        # since, each with its acquire's claim (a release queued behind it is
        # not written if that acquire turns out never sent or refused). A
        # value never released (a hold abandoned to its TTL) stays until the
        # client goes: a few bytes.
        self.owed: dict[bytes, Claim] = {}

    def busy(self, timeout: float) -> str | None:
        """Why a new request (other than an owed release) fails at once, or ``None``."""
        if self.pending >= MAX_PENDING:
            return f"{self.pending} requests for this key pending on this master"
        waited = self.loop.time() - self.head_since
        if self.pending and waited >= timeout:
            return f"no answer to a request for this key for {waited:.3f} s"
        return None

    def forget(self, claim: Claim) -> None:
        """Owe no release for ``claim``'s value: its acquire stored nothing here."""
        claim.stored = False
        if self.owed.get(claim.value) is claim:
            del self.owed[claim.value]

    def add(self, task: asyncio.Task[Any]) -> None:
        """Queue ``task``, the request sent next for this key."""
        if not self.pending:
            self.head_since = self.loop.time()
        self.pending += 1
        self.tail = task

    def finished(self, queues: dict[str, KeyQueue], key: str, task: asyncio.Task[Any]) -> None:
        """Take ``task``, now done, off the queue; drop the queue from ``queues`` once idle."""
        self.pending -= 1
        self.head_since = self.loop.time()  # the next request, if any, is sent now
        if not self.pending and not self.owed and queues.get(key) is self:
            del queues[key]
        # A request nobody waited for may fail later (its master died): its error
        # was either counted or does not matter, and asyncio must not log it as lost.
        if not task.cancelled():
            task.exception()


# Each client's queue for each lock key, shared by every Redlock of this
# process. Weak keys: the queues go with the client.
_queues: weakref.WeakKeyDictionary[Any, dict[str, KeyQueue]] = weakref.WeakKeyDictionary()


def queues_of(client: Any) -> dict[str, KeyQueue]:
    """The queues of ``client``, by lock key (``TypeError`` if it cannot be weakly referenced)."""
    queues = _queues.get(client)
    if queues is None:
        queues = _queues[client] = {}
    return queues
