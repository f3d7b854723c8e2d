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
from typing import Any, Union

import redis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from .lanes import Lane, changed
from .late_jobs import job_outcome, use_late_job
from .lua import Script
from .nodes import MAX_OWED, Connected, Node
from .sockets import INCOMPLETE, NOT_ENOUGH_DATA, PREFETCH_SIZE, prefetch, ready_reply, send
from .wire import Encoding, Request

__all__ = ["NOT_ASKED", "PENDING", "Round", "Settle"]

#: How often a caller waiting on both sockets and background jobs checks the jobs.
JOB_POLL = 0.001

#: Outcome of a master asked but not heard from (yet).
PENDING = object()
#: Outcome of a master this round did not ask.
NOT_ASKED = object()
#: ``settle(master index, reply or error)``: ``True`` once the round is decided.
Settle = Callable[[int, Any], bool]
#: A connection a round waits on: master index, connection, replies owed on it
#: before ours, whether it was reused (a failure may be a stale connection), the
#: lane it belongs to (``None``: a shared pool's), and the script the master
#: learns by running the request (``None``: none, or known already).
Reading = tuple[int, Any, int, bool, Union[Lane, None], Union[Script, None]]


class Round:
    """One request sent to every master at once; replies are collected as they arrive.

    :meth:`finish` must follow: it leaves the replies that were not awaited
    owed on their connections, to be read before the connection's next reply
    (see :meth:`Masters.ask`).

    Args:
        nodes: The masters.
        requests: What to send to each master; ``None`` skips it.
        claims: Reserved connections to send on, by master (see :meth:`Node.claim`).
        timeout: How long to wait for replies; by default the longest node timeout.
        lanes: This thread's lane to each master (``None`` for a master that
            cannot be polled, or for all of them); without one, connections
            come from the master's shared pool.
        send: ``False``: send nothing; a volley hands over what it sent
            (see :meth:`expect`, :meth:`write`, :meth:`read_owed`).
    """

    def __init__(
        self,
        nodes: Sequence[Node],
        requests: Sequence[Request | None],
        claims: dict[int, Any] | None = None,
        timeout: float | None = None,
        lanes: Sequence[Lane | None] | None = None,
        send: bool = True,
    ) -> None:
        self.nodes = nodes
        # A copy: a request sent again after a lost reply may differ from the first.
        self.requests = list(requests)
        self.outcomes: list[Any] = (
            [NOT_ASKED if r is None else PENDING for r in requests]
            if None in self.requests
            else [PENDING] * len(self.requests)
        )
        self.expired = False
        if timeout is None:
            timeout = max((node.timeout for node in nodes), default=0.0)
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.lanes: Sequence[Lane | None] = [None] * len(nodes) if lanes is None else lanes
        self._poll = select.poll()
        # fd -> what the round waits for on it (see Reading)
        self._reading: dict[int, Reading] = {}
        self._jobs: dict[concurrent.futures.Future[Any], int] = {}
        self._retried: set[int] = set()
        # Failures met while sending, reported to the first collect().
        self._failed: list[int] = []
        if send:
            self._send_all(claims)

    def _send_all(self, claims: dict[int, Any] | None) -> None:
        # Per master, everything a round does is inline for the common case (this
        # thread's lane, owing nothing, one write taking the whole command): at
        # five masters a round, calls cost more client CPU than the writes.
        nodes, lanes, reading, register = self.nodes, self.lanes, self._reading, self._poll.register
        # Usually one request for every master and one wire format: packed once.
        last_request: Request | None = None
        last_encoding: Encoding | None = None
        last_known = False
        packed: Any = None
        data: bytes | None = None
        for i, request in enumerate(self.requests):
            if request is None:
                continue
            node = nodes[i]
            lane = lanes[i]
            conn = None if lane is None else lane.conn
            if (
                conn is not None
                and not lane.busy  # type: ignore[union-attr]
                and not lane.owed  # type: ignore[union-attr]
                and lane.epoch == node.failures  # type: ignore[union-attr]
                and (not claims or i not in claims)
            ):
                skip = 0
                lane.busy = True  # type: ignore[union-attr]
            else:
                taken = self._connection(i, lane, claims.get(i) if claims else None)
                if taken is None:
                    self._start(i)
                    continue
                conn, skip, lane = taken
            script = request.script
            known = script is None or script.sha in node.scripts
            if (
                request is not last_request
                or known is not last_known
                or node.encoding != last_encoding
            ):
                packed = request.packed(conn, node)
                data = packed[0] if len(packed) == 1 else None
                last_request, last_encoding, last_known = request, node.encoding, known
            sock = conn._sock
            if data is not None and sock is not None:
                fd = sock.fileno()
                try:
                    sent = os.write(fd, data)
                except OSError:  # nothing written: send() tries again and reports
                    sent = 0
                if sent == len(data):
                    # Once a master runs a script sent with its source, it knows it.
                    reading[fd] = (i, conn, skip, True, lane, None if known else script)
                    register(fd, select.POLLIN)
                    continue
                self.write(i, conn, skip, True, [data[sent:]], lane)
            else:
                self.write(i, conn, skip, True, packed, lane)

    def _connection(
        self, i: int, lane: Lane | None, claim: Any
    ) -> tuple[Any, int, Lane | None] | None:
        """A connection to master ``i`` when the lane's is not free to use as it is.

        Returns it with the replies it owes before ours and the lane it belongs
        to (``None``: the shared pool's), or ``None``: open one with
        :meth:`Node.start`. A claimed connection still carries the request the
        new one must follow: it is this thread's lane's, or parked reserved.
        """
        node = self.nodes[i]
        if not node.pollable:
            return None
        conn = None if lane is None else lane.conn
        if claim is not None and claim is not conn:
            owed = node.claim(claim)
            if owed is not None:
                return claim, owed, None
        if lane is not None and conn is not None:
            if lane.epoch != node.failures or (lane.owed and lane.give_up <= time.monotonic()):
                # The master failed since (maybe restarted), or has owed
                # replies for the node timeout (hung).
                lane.drop(conn)
                conn.disconnect()
            elif not lane.busy and (lane.owed <= MAX_OWED or claim is conn):
                # Pipelined behind the replies it owes, which are read first.
                skip, lane.owed, lane.busy = lane.owed, 0, True
                return conn, skip, lane
        taken = node.checkout()
        return None if taken is None else (*taken, None)

    def _start(self, i: int) -> None:
        request = self.requests[i]
        assert request is not None
        try:
            self._jobs[self.nodes[i].start(request)] = i
        except RedisError as exc:
            # A retry refused a slot: its first send may still have run.
            self.outcomes[i] = redis.ConnectionError(str(exc)) if i in self._retried else exc
            self._failed.append(i)

    def write(
        self, i: int, conn: Any, skip: int, reused: bool, packed: Any, lane: Lane | None
    ) -> None:
        """Send ``packed`` to master ``i`` on ``conn`` and wait for the reply, behind ``skip``."""
        try:
            fd = send(conn, packed)
        except RedisError as exc:  # the connection closed itself
            if lane is not None:
                lane.drop(conn)
            self.nodes[i].failures += 1
            self.nodes[i].scripts.clear()
            changed()
            # Not all of it was sent, so it did not run: send it as it is.
            if not self._retry(i, reused, exc, self.requests[i]):
                self.outcomes[i] = exc
                self._failed.append(i)
            return
        self._wait(fd, (i, conn, skip, reused, lane, self.requests[i].script))  # type: ignore[union-attr]

    def expect(self, i: int, conn: Any, skip: int, lane: Lane | None) -> None:
        """Wait for master ``i``'s reply to a request sent on ``conn``, behind ``skip`` others."""
        if lane is not None:
            lane.busy = True
        self._wait(conn._sock.fileno(), (i, conn, skip, True, lane, None))

    def _wait(self, fd: int, entry: Reading) -> None:
        self._reading[fd] = entry
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
                if self._read(self._poll.poll(wait * 1000), settle):
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

    def _read(self, events: list[tuple[int, int]], settle: Settle) -> bool:
        # Every reply poll() reported, in one call; True once ``settle`` said
        # the round is decided. What prefetch() and ready_reply() do is inline
        # for the common case: the one reply owed, whole in one read, no error.
        reading, unregister, outcomes = self._reading, self._poll.unregister, self.outcomes
        decided = False
        for fd, _ in events:
            entry = reading.pop(fd)
            unregister(fd)
            i, conn, skip, _, lane, script = entry
            reader = None if skip else getattr(conn._parser, "_reader", None)
            if reader is None or conn._sock is None:
                decided = self.read_owed(fd, entry, settle, None) or decided
                continue
            try:
                data = os.read(fd, PREFETCH_SIZE)
            except OSError:  # _read_owed() reads again and reports
                data = b""
            if not data:
                decided = self.read_owed(fd, entry, settle, None) or decided
                continue
            reader.feed(data)
            try:
                reply = reader.gets()
            except BaseException as exc:
                # A protocol error leaves the stream unreadable, as redis-py has it.
                conn.disconnect()
                reply = exc
            if reply is NOT_ENOUGH_DATA:
                self._wait(fd, entry)
            elif isinstance(reply, BaseException):
                decided = self.read_owed(fd, entry, settle, reply) or decided
            else:
                if script is not None:
                    self.nodes[i].scripts.add(script.sha)
                if lane is not None:
                    lane.busy = False
                else:
                    self._done(i, conn)
                outcomes[i] = reply
                decided = settle(i, reply) or decided
        return decided

    def _done(self, i: int, conn: Any) -> None:
        # A shared pool's connection that has nothing left to read: it becomes
        # this thread's lane if the lane has none, or goes back to the pool.
        lane = self.lanes[i] if self.lanes is not None else None
        if lane is not None and lane.conn is None:
            lane.take(conn, self.nodes[i].failures)
        else:
            self.nodes[i].checkin(conn)

    def read_owed(self, fd: int, entry: Reading, settle: Settle, error: Any) -> bool:
        """Read ``entry``'s reply behind those owed, or handle ``error`` (an error reply, read)."""
        i, conn, skip, reused, lane, script = entry
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
                    changed()
                    skipped = None
                except ResponseError:
                    skipped = None
                if skipped is INCOMPLETE:
                    self._wait(fd, (i, conn, skip, reused, lane, script))
                    return False
                skip -= 1
            outcome = ready_reply(conn, reader)
            if outcome is INCOMPLETE:
                self._wait(fd, (i, conn, 0, reused, lane, script))
                return False
        except NoScriptError:
            node.scripts.clear()
            changed()
            self.write(i, conn, 0, False, conn.pack_command(*request.with_source()), lane)
            return False
        except ResponseError as exc:
            outcome = exc
        except RedisError as exc:
            # Maybe a restart, which empties the script cache too.
            node.scripts.clear()
            node.failures += 1
            changed()
            conn.disconnect()
            if lane is not None:
                lane.drop(conn)
            # It may have run, with only its reply lost: resend it as its script says.
            if self._retry(i, reused, exc, request.resent()):
                return False
            self.outcomes[i] = exc
            return settle(i, exc)
        else:
            if request.script is not None:
                node.scripts.add(request.script.sha)
        if lane is not None:
            lane.busy = False
        else:
            self._done(i, conn)
        self.outcomes[i] = outcome
        return settle(i, outcome)

    def _take_job(self, job: concurrent.futures.Future[Any], settle: Settle) -> bool:
        i = self._jobs.pop(job)
        outcome = job_outcome(self.nodes[i], job)
        if isinstance(outcome, Connected):
            request = self.requests[i]
            assert request is not None
            self.write(i, outcome.conn, 0, False, request.packed(outcome.conn, self.nodes[i]), None)
            return False
        self.outcomes[i] = outcome
        return settle(i, outcome)

    def finish(
        self, follow_up: Request | None = None, reserve: bool = False, any_thread: bool = False
    ) -> dict[int, Any]:
        """Stop waiting; leave the replies not awaited owed on their connections.

        A lane's connection stays with the lane, owing them; a shared pool's is
        parked (see :meth:`Node.park`).

        Args:
            follow_up: Sent to every master that has not answered, on the
                connection that carries the unanswered request, so the master
                runs it second even if it is hung now and resumes later.
            reserve: Keep those connections for the caller, who can claim
                them later (``claims`` of a round) to send something behind
                them: a lane keeps its own, for this thread; others are parked
                reserved (see :meth:`Node.claim`).
            any_thread: With ``reserve``, park lanes' connections too, so that
                another thread can claim them.

        Returns:
            The connections owing replies, by master index.
        """
        parked: dict[int, Any] = {}
        give_up = time.monotonic() + self.timeout if self._reading else 0.0
        for i, conn, skip, _, lane, _ in self._reading.values():
            owed = skip + 1
            if follow_up is not None:
                try:
                    conn.send_packed_command(
                        conn.pack_command(*follow_up.with_source()), check_health=False
                    )
                except RedisError:
                    if lane is not None:
                        lane.drop(conn)
                    continue
                owed += 1
            if lane is not None and not any_thread:
                lane.owed, lane.give_up, lane.busy = owed, give_up, False
            else:
                if lane is not None:
                    lane.drop(conn)
                self.nodes[i].park(conn, owed, give_up, reserved=reserve)
            parked[i] = conn
        for job, i in self._jobs.items():
            # A connection that comes too late for an acquire stays unused: an
            # acquire sent now could land after the release. Other requests
            # (release, renew) are still worth sending to it.
            late = None if reserve or follow_up is not None else self.requests[i]
            job.add_done_callback(functools.partial(use_late_job, self.nodes[i], late, follow_up))
        self._reading.clear()
        self._jobs.clear()
        return parked
