"""What one round sent as a volley answered: the caller's view of it, as of a finished Round.

Internal to :mod:`celery_redlock.core.volley`, which makes a :class:`Shot`
for each round it sends; :class:`~celery_redlock.core.quorum.Masters` hands
it to the Redlock, which reads the outcomes and finishes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .fanout import PENDING

if TYPE_CHECKING:
    from .volley import Volley

__all__ = ["Shot"]


class Shot:
    """One round a :class:`Volley` sent: each master's answer, and who still owes one.

    It answers as a finished :class:`Round` does (``outcomes``, ``expired``,
    :meth:`finish`) and is the caller's alone: the volley sends the thread's
    next rounds on the same lanes, which must not change what an earlier
    round's caller reads or finishes.
    """

    __slots__ = ("expired", "outcomes", "volley", "waiting")

    def __init__(self, volley: Volley, masters: int) -> None:
        self.volley = volley
        self.outcomes: list[Any] = [PENDING] * masters
        self.expired = False
        # Masters left owing this round's reply, their lanes busy until finish().
        self.waiting = False

    def finish(
        self, follow_up: Any = None, reserve: bool = False, any_thread: bool = False
    ) -> dict[int, Any]:
        """What :meth:`Round.finish` does, for the masters that had not answered.

        Their lanes already owe the reply; ``follow_up`` goes behind it on the
        same connection, and ``any_thread`` parks it reserved in the master's
        shared pool instead (see :meth:`Round.finish`).
        """
        parked: dict[int, Any] = {}
        if not self.waiting:
            return parked
        self.waiting = False
        volley = self.volley
        for i, outcome in enumerate(self.outcomes):
            lane, conn = volley.lanes[i], volley.conns[i]
            if outcome is not PENDING or lane.conn is not conn:
                continue
            lane.busy = False
            if not reserve and follow_up is None:
                continue
            if follow_up is not None:
                try:
                    conn.send_packed_command(
                        conn.pack_command(*follow_up.with_source()), check_health=False
                    )
                except Exception:
                    lane.drop(conn)
                    continue
                lane.owed += 1
            if any_thread:
                owed, give_up = lane.owed, lane.give_up
                lane.drop(conn)
                volley.nodes[i].park(conn, owed, give_up, reserved=reserve)
            parked[i] = conn
        return parked
