"""A master's background jobs: a few at once, one key's in order, releases waiting their turn.

Internal to :mod:`celery_redlock.core.nodes`, whose jobs on the process-wide
thread pool open connections, or run the requests of a master that cannot be
polled through its client. A master has a few job slots: a hung master ties
up that many pool threads, and further requests to it fail at once instead
of queueing behind them. Two kinds of request are not refused:

- the follow-up of a late request (``Request.behind``) starts at once: that
  request may still run, and would hold its key until the TTL;
- a release (``Request.may_wait``) waits for a slot, up to
  :data:`MAX_WAITING` of them per master, and takes the next one that frees,
  before any new request. Refused, it would leave its key on the master until
  the TTL; it is harmless whenever it runs (it deletes only its own token).
  Every job ends within its socket timeouts, so a master that never answers
  still frees its slots, and the waiting releases run (and fail) in turn,
  each as it would have with a slot free: waiting, they cost no thread, and
  the memory of at most :data:`MAX_WAITING` requests.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any, Union

from .through_client import NotSent
from .wire import Request

__all__ = ["MAX_WAITING", "JobSlots", "Run"]

#: Releases that may wait per master while its job slots are all taken.
MAX_WAITING = 16

#: What a job runs: ``run(request, previous job for its key or None)``.
Run = Callable[[Request, Union["concurrent.futures.Future[Any]", None]], Any]


class JobSlots:
    """One master's jobs on the thread pool: at most ``limit`` at once, one key's in order.

    Through a client, a master may run two connections' requests in either
    order: a release could run before the acquire it undoes, which would then
    hold the key for its whole TTL. So a request for a key starts only once
    the job of the previous request for that key has ended (the job is handed
    that one to wait for), as the asyncio Redlock chains its requests per key.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: Jobs running or queued on the pool.
        self.running = 0
        self._guard = threading.Lock()
        # Key -> the latest job for it: the next one for that key waits for it.
        self._chains: dict[Any, concurrent.futures.Future[Any]] = {}
        # Releases waiting for a slot, in order: (request, key, the future handed out).
        self._waiting: collections.deque[tuple[Request, Any, concurrent.futures.Future[Any]]] = (
            collections.deque()
        )

    def start(
        self, pool: concurrent.futures.Executor, run: Run, request: Request, key: Any
    ) -> concurrent.futures.Future[Any]:
        """Run ``run(request, previous)`` on ``pool``, behind the previous job for ``key`` if any.

        ``key`` is ``None`` for jobs that need no order. A release that finds
        every slot taken gets a future that ends with its job, once it has run.

        Raises:
            NotSent: If ``limit`` jobs are running or waiting (the master is
                not answering) and ``request`` may neither wait nor skip the
                line, or if ``pool`` takes no more jobs (the interpreter is exiting).
        """
        with self._guard:
            if self.running >= self.limit and not request.behind:
                if not request.may_wait or len(self._waiting) >= MAX_WAITING:
                    raise NotSent(f"{self.limit} connection attempts still pending")
                waiting: concurrent.futures.Future[Any] = concurrent.futures.Future()
                self._waiting.append((request, key, waiting))
                return waiting
            job = self._submit(pool, run, request, key)
        # Outside the lock: a job done already runs its callback right here.
        job.add_done_callback(functools.partial(self._done, pool, run, key))
        return job

    def _submit(
        self, pool: concurrent.futures.Executor, run: Run, request: Request, key: Any
    ) -> concurrent.futures.Future[Any]:
        # Under the lock, so that two threads chain in one order.
        previous = None if key is None else self._chains.get(key)
        try:
            job = pool.submit(run, request, previous)
        except RuntimeError as exc:
            # Shut down: at interpreter exit, no job is submitted any more.
            raise NotSent(f"not run: {exc}") from exc
        self.running += 1
        if key is not None:
            self._chains[key] = job
        return job

    def _done(
        self,
        pool: concurrent.futures.Executor,
        run: Run,
        key: Any,
        job: concurrent.futures.Future[Any],
    ) -> None:
        """A job ended: its slot goes to the first release waiting, if any.

        Once the pool takes no more jobs (the interpreter is exiting), every
        release waiting fails with :class:`NotSent` instead: none would ever run.
        """
        refused: list[tuple[concurrent.futures.Future[Any], NotSent]] = []
        started = None
        with self._guard:
            self.running -= 1
            if key is not None and self._chains.get(key) is job:
                del self._chains[key]
            while started is None and self._waiting and self.running < self.limit:
                request, waiting_key, waiting = self._waiting.popleft()
                try:
                    started = self._submit(pool, run, request, waiting_key)
                except NotSent as exc:
                    refused.append((waiting, exc))
        # Outside the lock: ending a future runs its callbacks here.
        for never_run, error in refused:
            never_run.set_exception(error)
        if started is not None:
            started.add_done_callback(functools.partial(self._done, pool, run, waiting_key))
            started.add_done_callback(functools.partial(_hand_on, waiting))


def _hand_on(waiting: concurrent.futures.Future[Any], job: concurrent.futures.Future[Any]) -> None:
    """End the future a waiting release was handed out with as its job ended."""
    error = job.exception()
    if error is None:
        waiting.set_result(job.result())
    else:
        waiting.set_exception(error)
