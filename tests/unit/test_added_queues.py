"""Locked queues a worker does not consume at start, and the check of a queue added later."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue

from celery_redlock.celery.added_queues import AddedQueuesStep, queue_to_add, refusal
from celery_redlock.celery.queues import QueueLocks, register


def app_with_queues(*queues: Queue) -> Celery:
    app = Celery("added", set_as_current=False, broker="memory://")
    app.conf.task_queues = list(queues) or None
    return app


def test_an_unconsumed_locked_queue_is_known_by_the_routes_add_consumer_gives_it():
    """Deliveries of a locked queue added later are recognised by pool processes forked before."""
    locks = QueueLocks({"reports": {}}, [Queue("default")])
    assert locks.consumed == frozenset()
    assert locks.queue_of({"exchange": "", "routing_key": "reports"}) == "reports"
    assert locks.queue_of({"exchange": "reports", "routing_key": "reports"}) == "reports"
    assert locks.queue_of({"exchange": "", "routing_key": "default"}) is None


def test_an_unconsumed_locked_queue_keeps_its_declared_binding():
    """A queue declared in task_queues is expected on its own exchange and routing key."""
    billing = Queue("billing", Exchange("tasks", type="direct"), routing_key="bill")
    locks = QueueLocks({"billing": {"ttl": 5}}, [Queue("default")], [billing])
    assert locks.queue_of({"exchange": "tasks", "routing_key": "bill"}) == "billing"
    assert locks.queue_of({"exchange": "billing", "routing_key": "billing"}) is None
    assert locks.refusal(billing) is None


def test_a_locked_queue_added_on_another_binding_is_refused():
    """Pool processes could not recognise it: its tasks would run without a lock."""
    locks = QueueLocks({"reports": {}}, [Queue("default")])
    elsewhere = Queue("reports", Exchange("other", type="direct"), routing_key="rk")
    assert "declare the queue in task_queues" in (locks.refusal(elsewhere) or "")
    assert locks.refusal(Queue("reports", Exchange("reports"), routing_key="reports")) is None


@pytest.mark.parametrize("kind", ["topic", "fanout"])
def test_an_unconsumed_locked_queue_on_a_non_direct_exchange_is_refused_when_added(kind):
    """Not an error at start (the worker may never consume it); refused if it is added."""
    queue = Queue("reports", Exchange("tasks", type=kind), routing_key="reports.#")
    locks = QueueLocks({"reports": {}}, [Queue("default")], [queue])
    assert f"{kind} exchange" in (locks.refusal(queue) or "")
    assert locks.queue_of({"exchange": "tasks", "routing_key": "reports.#"}) is None


def test_an_unlocked_queue_on_a_locked_queues_route_is_refused():
    """Its deliveries would be locked as the locked queue's: refused, like at start."""
    locks = QueueLocks({"reports": {}}, [Queue("default")])
    clash = Queue("other", Exchange("reports", type="direct"), routing_key="reports")
    assert "locked queue 'reports' has the same exchange 'reports'" in (locks.refusal(clash) or "")
    assert locks.refusal(Queue("other", Exchange("other"), routing_key="other")) is None


def test_a_locked_queue_on_the_route_of_an_unlocked_one_consumed_at_start_is_refused():
    """The route stays unlocked for the pool processes, so the locked queue cannot be added."""
    unlocked = Queue("other", Exchange("reports", type="direct"), routing_key="reports")
    locks = QueueLocks({"reports": {}}, [unlocked])
    assert locks.queue_of({"exchange": "reports", "routing_key": "reports"}) is None
    assert locks.queue_of({"exchange": "", "routing_key": "reports"}) == "reports"
    reason = locks.refusal(Queue("reports", Exchange("reports"), routing_key="reports"))
    assert "unlocked queue 'other', consumed at worker start" in (reason or "")


def test_queues_consumed_at_start_can_be_cancelled_and_added_again():
    """Re-adding a queue the worker consumed at start is allowed, locked or not."""
    reports, default = Queue("reports"), Queue("default")
    locks = QueueLocks({"reports": {}}, [reports, default])
    assert locks.consumed == {"reports"}
    assert locks.refusal(reports) is None and locks.refusal(default) is None


@pytest.mark.parametrize(
    ("exchange", "exchange_type", "routing_key"),
    [(None, None, None), ("ex", "direct", "rk"), ("ex", "topic", None), (None, None, "rk")],
)
def test_queue_to_add_builds_what_celery_adds(exchange, exchange_type, routing_key):
    """The queue checked before an addition is the one Celery's add_task_queue then consumes."""
    app, twin = app_with_queues(), app_with_queues()
    predicted = queue_to_add(app, "new", exchange, exchange_type, routing_key)
    # Consumer.add_task_queue's branch for a queue the app does not have.
    added = twin.amqp.queues.select_add(
        "new",
        exchange="new" if exchange is None else exchange,
        exchange_type=exchange_type or "direct",
        routing_key=routing_key,
    )
    assert (predicted.exchange.name, predicted.exchange.type, predicted.routing_key) == (
        added.exchange.name,
        added.exchange.type,
        added.routing_key,
    )
    assert "new" not in app.amqp.queues  # checking leaves no trace


def test_queue_to_add_uses_a_declared_queue_whatever_the_arguments():
    """As Celery: a queue the app has is consumed as declared, not as the arguments say."""
    billing = Queue("billing", Exchange("tasks", type="direct"), routing_key="bill")
    app = app_with_queues(billing)
    assert queue_to_add(app, "billing", "ex", "topic", "x") is app.amqp.queues["billing"]


class FakeConsumer:
    """What the step touches of a Celery consumer: its app, add and cancel."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.calls: list[tuple[Any, ...]] = []

    def add_task_queue(self, queue: str, exchange: Any = None, *rest: Any, **options: Any) -> None:
        self.calls.append(("add", queue, exchange, *rest))
        self.app.amqp.queues.select_add(queue, exchange=exchange or queue, routing_key=rest[-1])

    def cancel_task_queue(self, queue: str) -> None:
        self.calls.append(("cancel", queue))


def test_the_step_refuses_a_bad_addition_with_an_error_and_passes_a_good_one(caplog):
    """A refused queue is never added (an ERROR says why); an admitted one is added and locked."""
    app = app_with_queues()
    register(app, QueueLocks({"reports": {}}, [Queue("default")]))
    consumer = FakeConsumer(app)
    step = AddedQueuesStep(consumer)
    step.start(consumer)
    step.start(consumer)  # again after a lost connection: checked once
    with caplog.at_level(logging.INFO, logger="celery_redlock.celery.added_queues"):
        consumer.add_task_queue("reports", "other", "direct", "rk")
        assert consumer.calls == []
        assert "not consuming from queue 'reports'" in caplog.text
        consumer.add_task_queue("reports", None, "direct", None)
    assert consumer.calls == [("add", "reports", None, "direct", None)]
    assert "locking tasks from queue reports (added)" in caplog.text


def test_the_step_leaves_a_worker_without_locked_queues_alone():
    """No locked queue: add_task_queue stays Celery's own."""
    app = app_with_queues()
    register(app, QueueLocks({}, [Queue("default")]))
    consumer = FakeConsumer(app)
    original = consumer.add_task_queue
    AddedQueuesStep(consumer).start(consumer)
    assert consumer.add_task_queue == original


def test_a_locked_queue_whose_entry_cannot_apply_to_a_task_is_refused():
    """As at worker start, a queue entry no task can run under stops the queue, not a call."""
    app = app_with_queues()

    @app.task(shared=False, name="t", lock_on_conflict="requeue")
    def t() -> None: ...

    locks = QueueLocks({"reports": {"max_requeues": -1}}, [Queue("default")])
    assert "max_requeues" in (refusal(app, locks, Queue("reports")) or "")
