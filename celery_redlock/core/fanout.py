"""One request sent to every master at once, replies read with ``poll()`` as they arrive.

Internal to :mod:`celery_redlock.core.redlock`. Each caller thread writes its
command to one connection per master and waits on all their sockets at once,
returning as soon as its ``settle`` callback says the vote is decided. No
thread is involved on this path. Replies that come in after that are read the
next time their connection is needed, or the connection is closed once its
master has been silent for the node timeout.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import select
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from .nodes import Connected, Node
from .sockets import INCOMPLETE, NOT_ENOUGH_DATA, PREFETCH_SIZE, prefetch, ready_reply, send
from .wire import Encoding, Request

__all__ = ["NOT_ASKED", "PENDING", "Round", "Settle"]

#: How often a caller waiting on both sockets and background jobs checks the jobs.
JOB_POLL = 0.001
#: Most times the follow-up of a request run through a client is tried while it
#: fails (a hung master times each try out: a few node timeouts in all).
FOLLOW_UP_TRIES = 5

#: Outcome of a master asked but not heard from (yet).
PENDING = object()
#: Outcome of a master this round did not ask.
NOT_ASKED = object()
#: ``settle(master index, reply or error)``: ``True`` once the round is decided.
Settle = Callable[[int, Any], bool]


class Round:
    """One request sent to every master at once; replies are collected as they arrive.

    :meth:`finish` must follow: it parks the connections whose replies were not
    awaited (see :meth:`Masters.ask`).

    Args:
        nodes: The masters.
        requests: What to send to each master; ``None`` skips it.
        claims: Reserved connections to send on, by master (see :meth:`Node.claim`).
        timeout: How long to wait for replies; by default the longest node timeout.
    """

    def __init__(
        self,
        nodes: Sequence[Node],
        requests: Sequence[Request | None],
        claims: dict[int, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        self.nodes = nodes
        # A copy: a request sent again after a lost reply may differ from the first.
        self.requests = list(requests)
        self.outcomes: list[Any] = [NOT_ASKED if r is None else PENDING for r in requests]
        self.expired = False
        if timeout is None:
            timeout = max((node.timeout for node in nodes), default=0.0)
        self.deadline = time.monotonic() + timeout
        self._poll = select.poll()
        # fd -> (master index, connection, replies to skip before ours, reused)
        self._reading: dict[int, tuple[int, Any, int, bool]] = {}
        self._jobs: dict[concurrent.futures.Future[Any], int] = {}
        self._retried: set[int] = set()
        # Failures met while sending, reported to the first collect().
        self._failed: list[int] = []
        self._send_all(claims)

    def _send_all(self, claims: dict[int, Any] | None) -> None:
        # Per master, everything a round does is inline for the common case (an
        # idle or claimed connection, one write taking the whole command): at
        # five masters a round, calls cost more client CPU than the writes.
        nodes, reading, register = self.nodes, self._reading, self._poll.register
        # Usually one request for every master and one wire format: packed once.
        last: tuple[Request, Encoding, bool] | None = None
        packed: Any = None
        for i, request in enumerate(self.requests):
            if request is None:
                continue
            node = nodes[i]
            taken: tuple[Any, int] | None = None
            if node.pollable:
                claim = claims.get(i) if claims else None
                owed = node.claim(claim) if claim is not None else None
                taken = (claim, owed) if owed is not None else node.checkout()
            if taken is None:
                self._start(i)
                continue
            conn, skip = taken
            script = request.script
            known = script is None or script.sha in node.scripts
            if (
                last is None
                or last[0] is not request
                or last[1] != node.encoding
                or last[2] != known
            ):
                packed = request.packed(conn, node)
                last = (request, node.encoding, known)
            sock = conn._sock
            if sock is not None and sock.timeout is not None and len(packed) == 1:
                data = packed[0]
                fd = sock.fileno()
                try:
                    sent = os.write(fd, data)
                except OSError:  # nothing written: send() tries again and reports
                    sent = 0
                if sent == len(data):
                    reading[fd] = (i, conn, skip, True)
                    register(fd, select.POLLIN)
                    continue
                self._write(i, conn, skip, True, [data[sent:]])
            else:
                self._write(i, conn, skip, True, packed)

    def _start(self, i: int) -> None:
        request = self.requests[i]
        assert request is not None
        try:
            self._jobs[self.nodes[i].start(request)] = i
        except RedisError as exc:
            self.outcomes[i] = exc
            self._failed.append(i)

    def _write(self, i: int, conn: Any, skip: int, reused: bool, packed: Any) -> None:
        try:
            fd = send(conn, packed)
        except RedisError as exc:  # the connection closed itself
            self.nodes[i].scripts.clear()
            # Not all of it was sent, so it did not run: send it as it is.
            if not self._retry(i, reused, exc, self.requests[i]):
                self.outcomes[i] = exc
                self._failed.append(i)
            return
        self._wait(fd, i, conn, skip, reused)

    def _wait(self, fd: int, i: int, conn: Any, skip: int, reused: bool) -> None:
        self._reading[fd] = (i, conn, skip, reused)
        self._poll.register(fd, select.POLLIN)

    def _retry(self, i: int, reused: bool, exc: RedisError, again: Request | None) -> bool:
        # A connection that sat idle may have been closed by the server (restart,
        # idle timeout): try once more on a new one, as redis-py's pool would,
        # sending ``again`` (None: the request must not be sent twice).
        if not reused or not isinstance(exc, redis.ConnectionError) or i in self._retried:
            return False
        if again is None:
            return False
        self._retried.add(i)
        self.requests[i] = again
        self._start(i)
        return True

    def collect(self, settle: Settle) -> None:
        """Wait for replies, passing each to ``settle(index, reply or error)``.

        Stops once ``settle`` returned ``True``, once every master has answered,
        or at the deadline (the node timeout after sending). Replies that arrived
        together with the deciding one are read too: they cost no wait, and a
        connection left owing them would have to be read later or replaced.
        """
        while self._failed:
            i = self._failed.pop()
            if settle(i, self.outcomes[i]):
                return
        while self._reading or self._jobs:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.expired = True
                return
            if self._reading:
                wait = min(remaining, JOB_POLL) if self._jobs else remaining
                decided = False
                for fd, _ in self._poll.poll(wait * 1000):
                    decided = self._read(fd, settle) or decided
                if decided:
                    return
            else:
                concurrent.futures.wait(self._jobs, remaining, concurrent.futures.FIRST_COMPLETED)
            for job in [job for job in self._jobs if job.done()]:
                if self._take_job(job, settle):
                    return
            while self._failed:
                i = self._failed.pop()
                if settle(i, self.outcomes[i]):
                    return

    def _read(self, fd: int, settle: Settle) -> bool:
        i, conn, skip, reused = self._reading.pop(fd)
        self._poll.unregister(fd)
        if not skip:
            # What prefetch() and ready_reply() do, inline for the common case:
            # the one reply owed, whole in one read, and not an error.
            reader = getattr(conn._parser, "_reader", None)
            if reader is not None and conn._sock is not None:
                try:
                    data = os.read(fd, PREFETCH_SIZE)
                except OSError:  # prefetch() reads again and reports
                    data = b""
                if data:
                    reader.feed(data)
                    try:
                        reply = reader.gets()
                    except BaseException as exc:
                        # A protocol error leaves the stream unreadable, as redis-py has it.
                        conn.disconnect()
                        reply = exc
                    if reply is not NOT_ENOUGH_DATA and not isinstance(reply, BaseException):
                        node = self.nodes[i]
                        script = self.requests[i].script  # type: ignore[union-attr]
                        if script is not None:
                            node.scripts.add(script.sha)
                        node.checkin(conn)
                        self.outcomes[i] = reply
                        return settle(i, reply)
                    if reply is NOT_ENOUGH_DATA:
                        self._wait(fd, i, conn, 0, reused)
                        return False
                    return self._read_owed(fd, i, conn, 0, reused, settle, reply)
        return self._read_owed(fd, i, conn, skip, reused, settle, None)

    def _read_owed(
        self, fd: int, i: int, conn: Any, skip: int, reused: bool, settle: Settle, error: Any
    ) -> bool:
        # The general case: replies owed before ours, or ``error``, the error
        # reply _read() took (raised here as ready_reply() would).
        node = self.nodes[i]
        request = self.requests[i]
        assert request is not None
        try:
            if error is not None:
                if isinstance(error, redis.ConnectionError):
                    conn.disconnect()
                raise error
            reader = prefetch(conn, fd)
            while skip:
                # Replies to earlier requests on this connection come first.
                try:
                    skipped = ready_reply(conn, reader)
                except NoScriptError:
                    # An earlier script did not run here: resend sources for now.
                    node.scripts.clear()
                    skipped = None
                except ResponseError:
                    skipped = None
                if skipped is INCOMPLETE:
                    self._wait(fd, i, conn, skip, reused)
                    return False
                skip -= 1
            outcome = ready_reply(conn, reader)
            if outcome is INCOMPLETE:
                self._wait(fd, i, conn, 0, reused)
                return False
        except NoScriptError:
            node.scripts.clear()
            self._write(i, conn, 0, False, conn.pack_command(*request.with_source()))
            return False
        except ResponseError as exc:
            outcome = exc
        except RedisError as exc:
            # Maybe a restart, which empties the script cache too.
            node.scripts.clear()
            conn.disconnect()
            # It may have run, with only its reply lost: resend it as its script says.
            if self._retry(i, reused, exc, request.resent()):
                return False
            self.outcomes[i] = exc
            return settle(i, exc)
        else:
            if request.script is not None:
                node.scripts.add(request.script.sha)
        node.checkin(conn)
        self.outcomes[i] = outcome
        return settle(i, outcome)

    def _take_job(self, job: concurrent.futures.Future[Any], settle: Settle) -> bool:
        i = self._jobs.pop(job)
        try:
            result = job.result()
        except Exception as exc:
            self.nodes[i].scripts.clear()
            outcome: Any = exc
        else:
            if isinstance(result, Connected):
                request = self.requests[i]
                assert request is not None
                self._write(i, result.conn, 0, False, request.packed(result.conn, self.nodes[i]))
                return False
            outcome = result
        self.outcomes[i] = outcome
        return settle(i, outcome)

    def finish(self, follow_up: Request | None = None, reserve: bool = False) -> dict[int, Any]:
        """Stop waiting; park the connections of masters that have not answered.

        Args:
            follow_up: Sent to every master that has not answered, on the
                connection that carries the unanswered request, so the master
                runs it second even if it is hung now and resumes later.
            reserve: Park those connections for the caller, who can
                :meth:`Node.claim` them later to send something behind them.

        Returns:
            The parked connections, by master index.
        """
        parked: dict[int, Any] = {}
        for i, conn, skip, _ in self._reading.values():
            owed = skip + 1
            if follow_up is not None:
                try:
                    conn.send_packed_command(
                        conn.pack_command(*follow_up.with_source()), check_health=False
                    )
                except RedisError:
                    continue
                owed += 1
            self.nodes[i].park(conn, owed, reserved=reserve)
            parked[i] = conn
        for job, i in self._jobs.items():
            # A connection that comes too late for an acquire stays unused: an
            # acquire sent now could land after the release. Other requests
            # (release, renew) are still worth sending to it.
            late = None if reserve or follow_up is not None else self.requests[i]
            job.add_done_callback(functools.partial(_late, self.nodes[i], late, follow_up))
        self._reading.clear()
        self._jobs.clear()
        return parked


def _late(
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
    resumes, and an acquire would then hold the key with nobody to release it.
    """
    try:
        result = job.result()
    except Exception:
        if follow_up is not None and not node.pollable:
            _follow(node, follow_up, FOLLOW_UP_TRIES)
        return
    if not isinstance(result, Connected):
        if follow_up is not None:
            _follow(node, follow_up, FOLLOW_UP_TRIES)
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

    It goes on another connection than the request it follows, which a hung
    master may still run when it resumes; a try that fails before it is even
    sent (a new connection's handshake timing out) would leave that request
    in force. Trying again for a few node timeouts covers a master that hangs
    that long; one that hangs longer runs the request after the last try.
    """
    try:
        job = node.start(follow_up)
    except RedisError:
        return
    if tries > 1:

        def again(done: concurrent.futures.Future[Any]) -> None:
            if done.exception() is not None:
                _follow(node, follow_up, tries - 1)

        job.add_done_callback(again)
