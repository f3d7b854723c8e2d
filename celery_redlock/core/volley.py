"""A Redlock round on a thread's own connections, all ready: one loop sends, one counts.

Internal to :class:`~celery_redlock.core.quorum.Masters`. The general
:class:`~celery_redlock.core.fanout.Round` decides, per master and operation,
where a connection comes from, whether its master knows the script, how many
replies it owes and whether the write or the reply went wrong; at five masters
a round, those calls and checks cost the client more CPU than the system
calls. A :class:`Volley` makes the common round without them: this thread's
lane to every master holds a connection that nothing else is using, every
master knows the script, one packed request goes to all, and a persistent
``poll`` object, registered once, reports the replies, which are counted in
the same loop that reads them. Everything else (a lane without a connection,
a master that failed or owes replies for too long, a script to send with its
source, claims on other connections) is left to a ``Round``; so is anything
that goes wrong once the request is out: the volley hands the masters still
owing a reply to a ``Round``, which sends again, retries and reports as usual.

A volley's state is the lanes' own: ``Lane.owed`` counts the replies a lane's
connection owes, ours included, from the moment the request is written, and
a lane is ``busy`` from then until its reply is read, so whatever stops a
volley (an exception, the vote decided early) leaves every lane as a
``Round`` would: owing what it has not read, and taken by no other round
meanwhile (greenlets that share a thread's state, when gevent patched after
this was imported, take other connections). What one round's caller reads
and finishes is its own :class:`Shot`, never changed by a later round.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from . import lanes as lane_changes
from . import nodes as node_state
from .fanout import PENDING, Round
from .lanes import Lane
from .nodes import MAX_OWED, Node
from .shot import Shot
from .sockets import NOT_ENOUGH_DATA, PREFETCH_SIZE, served_directly
from .votes import GRANTED, Votes
from .wire import Template

__all__ = ["Volley", "volley_for"]


def volley_for(
    nodes: Sequence[Node], lanes: Sequence[Lane | None], timeout: float
) -> Volley | None:
    """The volley of ``nodes`` on ``lanes``, or ``None`` while one cannot be made.

    Every lane must hold an open connection that :func:`served_directly`
    allows (this thread has used every master), and every master must share
    one encoding, so that one packed request fits all.
    """
    # Taken before the checks: a failure any thread records meanwhile makes it stale.
    change = lane_changes.change
    if len({node.encoding for node in nodes}) != 1:
        return None
    conns = []
    for node, lane in zip(nodes, lanes):
        if lane is None or lane.conn is None or lane.busy or lane.epoch != node.failures:
            return None
        conn = lane.conn
        # Only redis-py's own connection classes (a subclass may change what
        # a read or write does), connected, with hiredis and no health checks.
        if not served_directly(conn):
            return None
        conns.append(conn)
    return Volley(nodes, lanes, conns, timeout, change)  # type: ignore[arg-type]


class Volley:
    """This thread's lanes to every master of one Redlock, sent to and read in one loop each.

    Made by :func:`volley_for`, kept per thread while the lanes keep their
    connections and no master fails (see :func:`lanes.changed`). Each
    :meth:`run` answers with a :class:`Shot`, as a finished :class:`Round`.
    """

    __slots__ = (
        "by_fd",
        "change",
        "conns",
        "encoding",
        "expired",
        "fds",
        "generation",
        "lanes",
        "nodes",
        "parts",
        "poll",
        "readers",
        "rows",
        "socks",
        "timeout",
    )

    def __init__(
        self,
        nodes: Sequence[Node],
        lanes: Sequence[Lane],
        conns: list[Any],
        timeout: float,
        change: int,
    ) -> None:
        self.nodes = tuple(nodes)
        self.lanes = tuple(lanes)
        self.conns = conns
        self.timeout = timeout
        # lanes.change when the lanes were checked: another value means stale.
        self.change = change
        self.generation = node_state.fork_generation()
        self.encoding = (nodes[0].encoding, False)
        self.socks = [conn._sock for conn in conns]
        self.readers = [conn._parser._reader for conn in conns]
        self.fds = [sock.fileno() for sock in self.socks]
        # What each round reads per master, unpacked in one step: for the
        # checks and writes (lane, connection, socket, fd), and by the fd
        # poll() reports (index, reader, lane).
        self.rows = tuple(zip(self.lanes, conns, self.socks, self.fds))
        self.by_fd = {
            fd: (i, reader, lane)
            for i, (fd, reader, lane) in enumerate(zip(self.fds, self.readers, self.lanes))
        }
        # Registered once: every round sends to every master, so each one it
        # reports readable owes this round a reply.
        self.poll = select.poll()
        for fd in self.fds:
            self.poll.register(fd, select.POLLIN)
        # Template -> its packed parts, once every master knows its script.
        self.parts: dict[Template, tuple[bytes, bytes]] = {}

    @property
    def current(self) -> bool:
        """Whether no fork happened and no master failed or forgot a script since it was made."""
        return (
            self.change == lane_changes.change and self.generation == node_state.fork_generation()
        )

    def _admit(self, template: Template) -> tuple[bytes, bytes] | None:
        """The packed parts of ``template``, once every master knows its script (else ``None``)."""
        script = template.script
        if script is not None and not all(script.sha in node.scripts for node in self.nodes):
            return None
        parts = self.parts[template] = template.parts(self.encoding)
        return parts

    # long because: checks and writes in one loop each; a call per master is what a volley saves
    def run(
        self,
        template: Template,
        value: bytes,
        claims: dict[int, Any] | None = None,
        expected: Any = GRANTED,
    ) -> tuple[Shot | Round, Votes] | None:
        """Send ``template`` with ``value`` to every master and count until the vote is decided.

        A reply agrees if it equals ``expected``, or with :data:`GRANTED`, if
        it is neither ``None`` nor a list (an acquire's refusals).

        Returns:
            The round's :class:`Shot` (or the :class:`Round` that took over
            after a failure) and the votes; ``None`` when this round needs a
            ``Round`` from the start (nothing was sent).
        """
        if self.change != lane_changes.change or self.generation != node_state.fork_generation():
            return None
        parts = self.parts.get(template) or self._admit(template)
        if parts is None:
            return None
        rows = self.rows
        now = time.monotonic()
        # Everything a Round checks per master and operation, in one loop.
        for lane, conn, sock, _ in rows:
            if lane.conn is not conn or conn._sock is not sock:
                self.change = -1  # the lane's connection was replaced: made again
                return None
            owed = lane.owed
            if lane.busy or (
                owed
                and (owed > MAX_OWED or lane.give_up <= now)
                and not self._drain(self.lanes.index(lane), now)
            ):
                return None
        if claims:
            conns = self.conns
            for i, conn in claims.items():
                if conn is not conns[i]:
                    return None
        data = b"%s$%d\r\n%s\r\n%s" % (parts[0], len(value), value, parts[1])
        size = len(data)
        write = os.write
        give_up = now + self.timeout
        # Written only partly or not at all: (master, what is left to send).
        broken: list[tuple[int, bytes]] = []
        for lane, _, _, fd in rows:
            try:
                sent = write(fd, data)
            except OSError:  # nothing written: the Round sends again and reports
                sent = 0
            if sent == size:
                lane.owed += 1
                lane.give_up = give_up
                # Until its reply is read: no other round may take it for its own.
                lane.busy = True
            else:
                broken.append((self.fds.index(fd), data[sent:]))
        shot = Shot(self, len(rows))
        try:
            if broken:
                return self._hand_over(shot, template, value, expected, 0, 0, broken, None, give_up)
            return self._count(shot, template, value, expected, give_up)
        except BaseException:
            # Interrupted while waiting (a signal, a time limit): the lanes
            # still owing this round's reply keep owing it, read first by the
            # next round on them, and are free again.
            shot.waiting = True
            shot.finish()
            raise

    # long because: one loop reads and counts every reply; a call per reply is what it saves
    def _count(
        self, shot: Shot, template: Template, value: bytes, expected: Any, deadline: float
    ) -> tuple[Shot | Round, Votes]:
        """Read the replies as ``poll()`` reports them, counting until the vote is decided.

        Replies that arrived together with the deciding one are read too: they
        cost no wait, and a lane left owing them reads them first next time.
        """
        outcomes, by_fd = shot.outcomes, self.by_fd
        poll, read = self.poll.poll, os.read
        n = len(outcomes)
        needed = n // 2 + 1
        spare = n - needed
        granted = refused = 0
        want_grant = expected is GRANTED
        left = n
        wait = self.timeout  # the writes took next to nothing of it
        while True:
            for fd, _ in poll(wait * 1000):
                i, reader, lane = by_fd[fd]
                if outcomes[i] is not PENDING:
                    # Nothing is owed on it: the server closed the connection.
                    # The next round finds out, on a Round.
                    self.poll.unregister(fd)
                    self.change = -1
                    continue
                try:
                    chunk = read(fd, PREFETCH_SIZE)
                except OSError:
                    chunk = b""
                if not chunk:
                    failure: tuple[int, Any] = (i, None)
                    return self._hand_over(
                        shot, template, value, expected, granted, refused, [], failure, deadline
                    )
                reader.feed(chunk)
                while True:
                    try:
                        reply = reader.gets()
                    except BaseException as exc:  # a protocol error: unreadable from here
                        self.conns[i].disconnect()
                        failure = (i, exc)
                        return self._hand_over(
                            shot, template, value, expected, granted, refused, [], failure, deadline
                        )
                    if reply is NOT_ENOUGH_DATA:
                        break
                    owed = lane.owed - 1
                    if (
                        type(reply) is not int
                        and isinstance(reply, BaseException)
                        and (not owed or not self._skipped_error(i, reply))
                    ):
                        return self._hand_over(
                            shot,
                            template,
                            value,
                            expected,
                            granted,
                            refused,
                            [],
                            (i, reply),
                            deadline,
                        )
                    lane.owed = owed
                    if owed:  # an earlier request's, nobody waits for it
                        continue
                    outcomes[i] = reply
                    lane.busy = False
                    left -= 1
                    if (
                        (reply is not None and type(reply) is not list)
                        if want_grant
                        else (reply == expected)
                    ):
                        granted += 1
                    else:
                        refused += 1
                    break
            if granted >= needed or refused > spare or not left:
                break
            wait = deadline - time.monotonic()
            if wait <= 0:
                shot.expired = True
                break
        # Like a Round's, the lanes of masters that have not answered stay
        # busy until finish(): a round made meanwhile (raising a fence) must
        # not take their replies for its own, and an undo goes behind them
        # on the same connections.
        shot.waiting = left > 0
        votes = Votes(n, granted)
        votes.refused = refused
        return shot, votes

    def _drain(self, i: int, now: float) -> bool:
        """Read the replies master ``i``'s lane owes that have arrived; ``True`` if it may be used.

        A lane owing more than ``MAX_OWED`` replies, or owing them for longer
        than the node timeout, is not sent on (a Round takes another
        connection, or closes it as hung), yet its replies have usually all
        arrived (a lock used again after a pause): nobody waits for them, so
        reading them costs no wait and keeps the connection.
        """
        lane, conn = self.lanes[i], self.conns[i]
        try:
            chunk = os.read(self.fds[i], PREFETCH_SIZE)
        except BlockingIOError:
            chunk = None
        except OSError:
            chunk = b""
        if chunk is None:  # nothing more has arrived
            return lane.owed <= MAX_OWED and lane.give_up > now
        reader = self.readers[i]
        try:
            if not chunk:
                raise ConnectionError("closed by the server")
            reader.feed(chunk)
            while lane.owed:
                reply = reader.gets()
                if reply is NOT_ENOUGH_DATA:
                    break
                if isinstance(reply, BaseException) and not self._skipped_error(i, reply):
                    raise reply
                lane.owed -= 1
        except Exception:
            # Closed, a protocol error or a connection-level error reply: the
            # connection goes, as a Round's would; the next round opens another.
            conn.disconnect()
            lane.drop(conn)
            node = self.nodes[i]
            node.failures += 1
            node.scripts.clear()
            lane_changes.changed()
            return False
        return not lane.owed or (lane.owed <= MAX_OWED and lane.give_up > now)

    def _skipped_error(self, i: int, error: BaseException) -> bool:
        # An error reply to an earlier request nobody waits for: what a Round
        # does with it. A master that did not know a script sends sources
        # again; other error replies are that request's business. A
        # connection-level one is not skipped: the Round closes and retries.
        if isinstance(error, NoScriptError):
            self.nodes[i].scripts.clear()
            lane_changes.changed()
            return True
        return isinstance(error, ResponseError)

    # long because: the Round takes each master's state over in its own way
    def _hand_over(
        self,
        shot: Shot,
        template: Template,
        value: bytes,
        expected: Any,
        granted: int,
        refused: int,
        broken: list[tuple[int, bytes]],
        failure: tuple[int, Any] | None,
        deadline: float,
    ) -> tuple[Round, Votes]:
        """Let a :class:`Round` finish what went wrong: a write, a read or an error reply.

        Masters still owing this round's reply are waited for by the Round,
        behind the replies they owe; ``broken`` ones get the rest of the
        request; ``failure``'s master has its error handled (resent, retried or
        counted) as the Round does for its own.
        """
        self.change = -1  # made again, from lanes the Round may have replaced
        request = template.request(value)
        nodes, lanes, conns = self.nodes, self.lanes, self.conns
        round_ = Round(nodes, [request] * len(nodes), None, self.timeout, lanes, send=False)
        # The node timeout runs from the volley's writes, not from here.
        round_.deadline = deadline
        votes = Votes(len(nodes), granted)
        votes.refused = refused
        settle = votes.settle(None, expected)
        unsent = {i for i, _ in broken}
        failed = None if failure is None else failure[0]
        for i, outcome in enumerate(shot.outcomes):
            round_.outcomes[i] = outcome
            if outcome is PENDING and i not in unsent and i != failed:
                # Sent, not answered yet: the lane owes its reply last.
                lane = lanes[i]
                skip, lane.owed = lane.owed - 1, 0
                round_.expect(i, conns[i], skip, lane)
        for i, rest in broken:
            lane = lanes[i]
            skip, lane.owed, lane.busy = lane.owed, 0, True
            round_.write(i, conns[i], skip, True, [rest], lane)
        if failure is not None:
            i, error = failure
            lane = lanes[i]
            # Owed: the replies before ours, and ours (or the error reply, taken).
            skip, lane.owed, lane.busy = max(lane.owed - 1, 0), 0, True
            entry = (i, conns[i], skip, True, lane, None)
        try:
            if failure is None or not round_.read_owed(self.fds[i], entry, settle, error):
                round_.collect(settle)
        except BaseException:
            # The Round holds the lanes now: only its finish() leaves them owing
            # what they owe, and free.
            round_.finish()
            raise
        return round_, votes
