"""The asyncio Redlock's masters: one request sent to each, and the majority rule.

Each master's request runs in a task of its own, behind the previous request
for the same key through the same client (:mod:`.ordering`); the vote is
counted with the thread version's rule (:class:`~celery_redlock.core.quorum.Votes`).
A script's reply is awaited ``KEEP_FOR`` node timeouts at least, whatever the
client's ``socket_timeout``: giving up closes the connection, and the request
queued behind (the release of an acquire) would go on another one, which a
master resuming from a pause may run first. A request whose connection could
not be opened raises ``NotSent`` and is owed no release.
Used by :class:`~celery_redlock.asyncio.redlock.Redlock`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Sequence
from typing import Any, Callable

from celery_redlock.core.exceptions import LockNotOwned, QuorumNotAchieved
from celery_redlock.core.fanout import NOT_ASKED, PENDING
from celery_redlock.core.lease import Lease
from celery_redlock.core.lua import Arg, Script
from celery_redlock.core.nodes import node_address
from celery_redlock.core.quorum import Votes, lost_vote
from celery_redlock.core.scripts import RELEASE, RENEW
from celery_redlock.core.through_client import KEEP_FOR, NotSent

from .ordering import Claim, KeyQueue, queues_of
from .scripts import run_script
from .shielding import detach

__all__ = ["Masters", "Request", "Round", "Settle"]

#: One master's request: given the master's client, the coroutine to run.
Request = Callable[[Any], Awaitable[Any]]
#: Told each master's reply or error; answers ``True`` once the vote is decided.
Settle = Callable[[int, Any], bool]


def _node_name(client: Any) -> str:
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    return repr(client) if kwargs is None else node_address(kwargs)


async def _answer(reply: Any) -> Any:
    return reply


async def _fail(error: BaseException) -> Any:
    raise error


class Round:
    """One request sent to some masters, each in a task of its own."""

    def __init__(self, size: int, tasks: dict[int, asyncio.Task[Any]]) -> None:
        self.tasks = tasks
        self.outcomes: list[Any] = [PENDING if i in tasks else NOT_ASKED for i in range(size)]
        self.expired = False


class Masters:
    """The masters of one Redlock: fan-out of one request, and the majority rule."""

    def __init__(self, clients: Sequence[Any], name: str, timeout: float) -> None:
        self.clients = tuple(clients)
        self.names = tuple(_node_name(client) for client in clients)
        self.name = name
        self.timeout = timeout
        self.quorum = len(clients) // 2 + 1
        # How long a script's reply is awaited once sent, whatever the client's
        # socket_timeout: as long as the thread version keeps a connection
        # owing a reply. Giving up closes the connection, and the key's next
        # request (the release behind an acquire) would go on another one,
        # which the master may run first when it resumes.
        self.patience = KEEP_FOR * timeout
        self._queues: list[dict[str, KeyQueue]] = [{} for _ in clients]

    def script(self, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Request:
        """The request that runs ``script`` with these KEYS and ARGV on a master."""
        patience = self.patience
        return lambda client: run_script(script, client, keys, args, patience=patience)

    def send(
        self,
        request: Request,
        only: Sequence[int] | None = None,
        *,
        acquires: bytes | None = None,
        releases: bytes | None = None,
    ) -> Round:
        """Start ``request`` on every master (or those in ``only``), without waiting.

        Each master gets it once the previous request for this key through the
        same client has answered or failed, so a master runs them in order; or
        it fails at once while that master is not answering this key (see
        :class:`KeyQueue`). ``acquires`` is the value the request may store (an
        acquire: it refuses with a list), ``releases`` the value it deletes.
        """
        loop = asyncio.get_running_loop()
        targets = range(len(self.clients)) if only is None else only
        tasks = {}
        for i in targets:
            queue = self._queue(i, loop)
            releasing: Claim | None = None
            if releases is not None:
                releasing = queue.owed.pop(releases, None)
                if releasing is None:
                    tasks[i] = detach(_answer(0))
                    continue
            else:
                busy = queue.busy(self.timeout)
                if busy is not None:
                    tasks[i] = detach(_fail(NotSent(busy)))
                    continue
            claim = None
            if acquires is not None:
                claim = queue.owed[acquires] = Claim(acquires)
            task = detach(self._one(self.clients[i], request, queue.tail, queue, claim, releasing))
            queue.add(task)
            task.add_done_callback(functools.partial(queue.finished, self._queues_of(i), self.name))
            tasks[i] = task
        return Round(len(self.clients), tasks)

    def _queues_of(self, i: int) -> dict[str, KeyQueue]:
        try:
            return queues_of(self.clients[i])
        except TypeError:  # a client that cannot be weakly referenced
            return self._queues[i]

    def _queue(self, i: int, loop: asyncio.AbstractEventLoop) -> KeyQueue:
        queues = self._queues_of(i)
        queue = queues.get(self.name)
        # Requests left on a loop that is gone never finish: start afresh.
        if queue is None or queue.loop is not loop:
            queue = queues[self.name] = KeyQueue(loop)
        return queue

    @staticmethod
    async def _one(
        client: Any,
        request: Request,
        before: asyncio.Task[Any] | None,
        queue: KeyQueue,
        claim: Claim | None,
        releasing: Claim | None,
    ) -> Any:
        if before is not None and not before.done():
            await asyncio.wait([before])
        if releasing is not None and not releasing.stored:
            return 0  # the release of an acquire that stored nothing here: not deleted
        try:
            reply = await request(client)
        except NotSent:
            # Never written: the master cannot have run it, no release owed.
            if claim is not None:
                queue.forget(claim)
            raise
        if claim is not None and isinstance(reply, list):
            # Refused ("held by"): nothing of ours is stored here, no release owed.
            queue.forget(claim)
        return reply

    async def collect(self, round_: Round, settle: Settle | None = None) -> None:
        """Wait for replies, passing each to ``settle(index, reply or error)``.

        Stops once ``settle`` returned ``True``, once every master has answered,
        or at the node timeout. Requests still running go on: see the module's
        docstring for why they are not cancelled.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        index = {task: i for i, task in round_.tasks.items()}
        waiting = set(index)
        while waiting:
            left = deadline - loop.time()
            if left <= 0:
                round_.expired = True
                return
            done, waiting = await asyncio.wait(
                waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            decided = False
            for i in sorted(index[task] for task in done):
                task = round_.tasks[i]
                outcome = (
                    asyncio.CancelledError() if task.cancelled() else task.exception()
                ) or task.result()
                round_.outcomes[i] = outcome
                if settle is not None and settle(i, outcome):
                    decided = True
            if decided:
                return

    async def vote(
        self,
        request: Request,
        agrees: Callable[[int, Any], bool],
        *,
        acquires: bytes | None = None,
        releases: bytes | None = None,
    ) -> tuple[Round, Votes]:
        """Send ``request`` to every master and count until a majority is won or lost."""
        votes = Votes(len(self.clients))
        round_ = self.send(request, acquires=acquires, releases=releases)
        await self.collect(round_, votes.settle(agrees))
        return round_, votes

    def failure(
        self, message: str, round_: Round, votes: Votes, refusal: Callable[[Any], Any]
    ) -> QuorumNotAchieved:
        """The error of a lost vote, with each master's reason (as the thread version's)."""
        return lost_vote(
            message,
            self.name,
            self.names,
            round_.outcomes,
            votes,
            refusal,
            self.timeout,
            round_.expired,
        )

    async def renew(self, lease: Lease, ms: int, replace: bool = True) -> int:
        """Renew ``lease`` on a majority: the shortest new TTL among them, 0 if not ours.

        Raises:
            QuorumNotAchieved: If too few masters answered to tell.
        """
        pttls: list[int] = []

        def agrees(i: int, reply: Any) -> bool:
            if reply and int(reply[0]) > 0:
                pttls.append(int(reply[0]))
                return True
            return False

        request = self.script(RENEW, (lease.name,), ("1" if replace else "0", lease.token, ms))
        round_, votes = await self.vote(request, agrees)
        if votes.won:
            return min(pttls)
        if votes.refused_by_majority:
            # Masters that still hold our token would keep others out until it expires.
            self.send(self.script(RELEASE, (lease.name,), (lease.token, "0")), releases=lease.token)
            return 0
        raise self.failure(
            f"Cannot renew lock {lease.name}",
            round_,
            votes,
            lambda reply: (
                None if reply and int(reply[0]) > 0 else LockNotOwned("not ours", self.name)
            ),
        )
