"""The worker's counters are fed directly; the public signals still reach every receiver."""

from __future__ import annotations

import time
from typing import Any

from celery import Celery

from celery_redlock.celery import events, metrics, signals, stats


def test_a_receiver_connected_after_the_counters_gets_every_event_and_counts_stay_exact():
    """Receivers connected or disconnected after the counters started see exactly their events."""
    app = Celery("signal-hooks", set_as_current=False)

    @app.task(name="t.hooked", shared=False)
    def hooked() -> None:
        """A task to send lock events for."""

    task = app.tasks["t.hooked"]
    table = stats.enable(app, processes=1)  # as the worker does at start
    waits = metrics.enable(app, processes=1)
    received: list[tuple[str, Any, dict[str, Any]]] = []

    def receiver(name: str) -> Any:
        def receive(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
            received.append((name, sender, kwargs))

        return receive

    def one_of_each(task_id: str) -> None:
        events.send_acquired(task, task_id, "k", 5, 2.0, None)
        events.send_contended(task, task_id, "k", "h", "skip", 1, None)
        events.send_lost(task, task_id, "k", 5, "expired")
        events.send_released(task, task_id, "k", 5, True)

    one_of_each("before")  # no receiver yet: counted, nothing dispatched
    receivers = {name: receiver(name) for name in ("acquired", "contended", "lost", "released")}
    for name, receive in receivers.items():
        getattr(signals, f"lock_{name}").connect(receive, weak=False)
    try:
        one_of_each("during")
        late: list[Any] = []  # a second receiver, connected after the first was cached

        def receive_late(sender: Any = None, **kwargs: Any) -> None:
            late.append(kwargs["task_id"])

        signals.lock_acquired.connect(receive_late, weak=False)
        one_of_each("later")
        signals.lock_acquired.disconnect(receive_late)
    finally:
        for name, receive in receivers.items():
            getattr(signals, f"lock_{name}").disconnect(receive)
    one_of_each("after")  # disconnected: counted, not dispatched

    assert [(name, sender, kwargs["task_id"]) for name, sender, kwargs in received] == [
        (name, task, task_id)
        for task_id in ("during", "later")
        for name in ("acquired", "contended", "lost", "released")
    ]
    assert [kwargs for _, _, kwargs in received[:4]] == [
        {"task_id": "during", "key": "k", "fence": 5, "ttl": 2.0, "waited": None},
        {
            "task_id": "during",
            "key": "k",
            "holder": "h",
            "action": "skip",
            "attempt": 1,
            "line": None,
        },
        {"task_id": "during", "key": "k", "fence": 5, "reason": "expired"},
        {"task_id": "during", "key": "k", "fence": 5, "owned": True},
    ]
    assert late == ["later"]
    counts = table.totals()["t.hooked"]
    assert (counts["acquired"], counts["skipped"], counts["lost"], counts["released"]) == (
        4,
        4,
        4,
        4,
    )
    assert waits.snapshot()[1] == {"t.hooked": 0}  # four holds taken, four ended
    assert waits.totals()["t.hooked"]["taken"] == 4
    # A run that timed its start lands in the lock wait histogram (0.25 s wait).
    events.send_acquired(task, "timed", "k", 6, 2.0, None, time.monotonic() - 0.25)
    histogram = waits.snapshot()[0]["t.hooked"]
    assert histogram["count"] == 1 and histogram["sum"] >= 0.25
