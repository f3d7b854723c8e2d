"""Which queue a delivery came from, and how redlock_queues is read."""

from __future__ import annotations

import pytest
from kombu import Exchange, Queue

from celery_redlock import ConfigurationError
from celery_redlock.celery.queues import QueueLocks
from celery_redlock.celery.settings import parse_queues


def test_default_routing_finds_the_queue_by_name():
    """With the anonymous exchange the routing key is the queue name."""
    locks = QueueLocks({"reports": {}}, [Queue("reports"), Queue("other")])
    assert locks.queue_of({"exchange": "", "routing_key": "reports"}) == "reports"
    assert locks.queue_of({"exchange": "", "routing_key": "other"}) is None
    assert locks.queue_of(None) is None


def test_named_exchange_routes_are_recognised():
    """A queue bound to a named exchange is found by exchange and routing key."""
    billing = Queue("billing", Exchange("tasks", type="direct"), routing_key="bill")
    locks = QueueLocks({"billing": {"ttl": 5}}, [billing])
    assert locks.queue_of({"exchange": "tasks", "routing_key": "bill"}) == "billing"
    assert locks.queue_of({"exchange": "tasks", "routing_key": "other"}) is None


def test_a_route_shared_by_locked_and_unlocked_queues_is_refused():
    """If a delivery could come from a locked or an unlocked queue, the worker must not start."""
    exchange = Exchange("tasks", type="direct")
    queues = [Queue("a", exchange, routing_key="x"), Queue("b", exchange, routing_key="x")]
    with pytest.raises(ConfigurationError, match="cannot tell them apart"):
        QueueLocks({"a": {}}, queues)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, {}),
        ("reports, billing", {"reports": {}, "billing": {}}),
        (["reports"], {"reports": {}}),
        ({"reports": {"ttl": 5}, "billing": None}, {"reports": {"ttl": 5}, "billing": {}}),
    ],
)
def test_queue_settings_accept_names_lists_and_mappings(value, expected):
    """redlock_queues takes a comma list, a list, or a mapping of options."""
    assert parse_queues(value) == expected


@pytest.mark.parametrize(
    ("value", "setting"),
    [
        (5, "redlock_queues"),
        ({"reports": {"tll": 5}}, "redlock_queues['reports']"),
        ({"reports": 5}, "redlock_queues['reports']"),
        ([""], "redlock_queues"),
        ("", "redlock_queues"),
        (" , ", "redlock_queues"),
    ],
)
def test_bad_queue_settings_name_the_culprit(value, setting):
    """A malformed redlock_queues names the setting and queue at fault."""
    with pytest.raises(ConfigurationError) as info:
        parse_queues(value)
    assert info.value.setting == setting


@pytest.mark.parametrize("kind", ["topic", "fanout", "headers"])
def test_a_locked_queue_on_a_non_direct_exchange_is_refused(kind):
    """Wildcard and broadcast routes cannot identify the queue: refuse at worker start."""
    queue = Queue("reports", Exchange("tasks", type=kind), routing_key="reports.#")
    with pytest.raises(ConfigurationError, match=f"{kind} exchange"):
        QueueLocks({"reports": {}}, [queue])
    QueueLocks({}, [queue])  # unlocked, it is none of our business
