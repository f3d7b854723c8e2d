"""A Redlock round's background jobs: their outcome, and what becomes of one that ends late.

Internal to :mod:`celery_redlock.core.fanout`: a connection opened too late, or
a request run through a client (a master that cannot be polled) whose
follow-up must still go after it.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from redis.exceptions import RedisError

from .lanes import changed
from .nodes import Connected, Node
from .through_client import NotSent, Unanswered
from .wire import Request

__all__ = ["FOLLOW_UP_TRIES", "job_outcome", "use_late_job"]

#: Most times the follow-up of a request run through a client is tried while it
#: fails before it is sent (a hung master times each new connection's
#: handshake out: a few node timeouts in all).
FOLLOW_UP_TRIES = 5


def job_outcome(node: Node, job: concurrent.futures.Future[Any]) -> Any:
    """A finished background job's result (a :class:`Connected`, or a reply), or its error.

    A failure may be a restart, which empties the master's script cache: its
    scripts go with their source until it shows it knows them again.
    """
    # exception(), not result(): raised again here, the error would keep this
    # thread's frames (the lock's among them) in a cycle through the job.
    error = job.exception()
    if error is None:
        return job.result()
    node.scripts.clear()
    changed()
    return error


def use_late_job(
    node: Node,
    request: Request | None,
    follow_up: Request | None,
    job: concurrent.futures.Future[Any],
) -> None:
    """Use a background job that finished after its round was over.

    A new connection carries ``request``, if any, or goes idle. A request run
    through a client (a master that cannot be polled) has now run, or failed,
    so its ``follow_up`` goes after it. It goes after a failure too: a request
    that timed out waiting for its reply may still be run by a master that
    resumes, and an acquire would then hold the key with nobody to release it;
    the follow-up then goes behind it on its connection. Not after a request
    that was never written (:class:`NotSent`): the master cannot have run it.
    """
    error = job.exception()  # not raised again: see job_outcome
    if isinstance(error, NotSent):
        return  # the master never got the request: nothing to follow
    if error is not None:
        if follow_up is not None and not node.pollable:
            _follow(node, follow_up.following(), FOLLOW_UP_TRIES)
        return
    result = job.result()
    if not isinstance(result, Connected):
        if follow_up is not None:
            _follow(node, follow_up.following(), FOLLOW_UP_TRIES)
        return
    conn = result.conn
    if request is None:
        node.checkin(conn)
        return
    try:
        conn.send_packed_command(conn.pack_command(*request.with_source()), check_health=False)
    except RedisError:
        return
    node.park(conn, 1)


def _follow(node: Node, follow_up: Request, tries: int) -> None:
    """Run ``follow_up`` through ``node``'s client; try again while it fails, ``tries`` in all.

    A request that timed out left its connection owing the reply, and the
    follow-up goes behind it there (see :mod:`~celery_redlock.core.through_client`): once sent,
    the master runs it second whenever it resumes, answered in time or not.
    A follow-up that goes on another connection (the request's failed) may
    fail before it is even sent (a new connection's handshake timing out),
    which would leave the request in force: it is tried again for a few node
    timeouts.
    """
    try:
        job = node.start(follow_up)
    except RedisError:
        return
    if tries > 1:

        def again(done: concurrent.futures.Future[Any]) -> None:
            error = done.exception()
            if error is not None and not isinstance(error, Unanswered):
                _follow(node, follow_up, tries - 1)

        job.add_done_callback(again)
