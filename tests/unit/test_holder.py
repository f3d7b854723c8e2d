"""The lock value carries its holder and round-trips through Redis's bytes."""

from __future__ import annotations

import os
import time

from celery_redlock.core.holder import Holder, queue_of


def test_holder_round_trips_and_tokens_are_unique():
    """encode/parse are inverse, and two holders of one task never share a value."""
    first, second = Holder.new("task-1", "w1@host"), Holder.new("task-1", "w1@host")
    assert first.encode() != second.encode()
    assert Holder.parse(first.encode().encode()) == first
    assert first.pid == os.getpid()


def test_separator_in_fields_cannot_forge_fields():
    """A task id containing the separator cannot shift the other fields."""
    holder = Holder.new("evil|id|x", "host")
    parsed = Holder.parse(holder.encode())
    assert parsed is not None
    assert parsed.hostname == "host"
    assert parsed.pid == os.getpid()


def test_foreign_values_parse_as_unknown():
    """Values written by someone else (or nothing) parse to None instead of failing."""
    assert Holder.parse(None) is None
    assert Holder.parse("plain-token") is None
    assert Holder.parse(b"v1|a|b|c|notapid") is None


def test_fragment_names_exactly_one_task_on_one_worker():
    """The fragment matches values of that task on that worker, and no other's."""
    value = Holder.new("task-1", "w1@host").encode()
    assert Holder.fragment("task-1", "w1@host") in value
    assert Holder.fragment("task-1", "w2@host") not in value
    assert Holder.fragment("task-12", "w1@host") not in Holder.new("task-1", "w1@host").encode()
    assert Holder.fragment("task", "1|w1@host") not in value


def test_v2_value_carries_acquisition_time_ttl_host_and_queue():
    """The value records when, for how long, on which machine and from which queue."""
    holder = Holder.new("task-1", "w1@node", ttl=2.5, queue="q1")
    parsed = Holder.parse(holder.encode())
    assert parsed == holder
    assert parsed.ttl_ms == 2500 and parsed.queue == "q1" and parsed.host
    assert abs(parsed.acquired_ms / 1000 - time.time()) < 5
    assert holder.encode().startswith("v2|")


def test_v1_values_still_parse():
    """Locks written by the previous format are read, without the fields it lacked."""
    parsed = Holder.parse(b"v1|tok|task-1|w1@node|123")
    assert parsed == Holder(task_id="task-1", hostname="w1@node", pid=123, token="tok")
    assert parsed.acquired_ms is None and parsed.host is None


def test_no_ttl_and_no_queue_round_trip():
    """A lock without expiry or known queue encodes both as empty and reads them back."""
    holder = Holder.new("t", "n")
    parsed = Holder.parse(holder.encode())
    assert parsed is not None and parsed.ttl_ms == 0 and parsed.queue is None


def test_queue_of_reads_direct_routes_only():
    """The default direct route names the queue; a named exchange does not."""
    assert queue_of({"exchange": "", "routing_key": "q1"}) == "q1"
    assert queue_of({"exchange": "tasks", "routing_key": "q1"}) is None
    assert queue_of(None) is None


def test_separator_and_percent_in_fields_read_back_unchanged():
    """Task id, node, host and queue come back exactly, whatever "|" and "%" they hold."""
    holder = Holder(
        task_id="order|42%7C%",
        hostname="w|1%25@node",
        pid=7,
        token="tok",
        acquired_ms=1,
        ttl_ms=2500,
        host="host|a",
        queue="q|1%",
    )
    value = holder.encode()
    assert value.count("|") == 8
    assert Holder.parse(value) == holder
    assert Holder.parse(value.encode()) == holder


def test_values_without_separator_or_percent_are_written_as_before():
    """Escaping leaves ordinary values byte-identical, so locks already held keep matching."""
    holder = Holder("task-1", "w1@node", 123, "tok", 1700000000000, 2500, "host-a", "q1")
    assert holder.encode() == "v2|tok|task-1|w1@node|123|1700000000000|2500|host-a|q1"


def test_fragment_matches_escaped_values_of_exactly_that_task_and_worker():
    """The fragment is written as encode writes the fields, and escaping keeps ids apart."""
    value = Holder.new("order|42", "w|1").encode()
    assert Holder.fragment("order|42", "w|1") in value
    assert Holder.fragment("order_42", "w_1") not in value
    assert Holder.fragment("order|42", "w_1") not in value
    assert Holder.fragment("order", "42|w|1") not in value
    assert Holder.fragment("order|42", "w|1") not in Holder.new("order_42", "w_1").encode()
    assert Holder.fragment("a%7Cb", "w") not in Holder.new("a|b", "w").encode()


def test_values_written_before_the_escape_still_parse():
    """Older versions wrote "_" for "|" and "%" as is: such values read as they were written."""
    parsed = Holder.parse(b"v2|tok|order_42|w_1@node|123|1700000000000|0|host|q%20x")
    assert parsed is not None
    assert (parsed.task_id, parsed.hostname, parsed.queue) == ("order_42", "w_1@node", "q%20x")
    old = Holder.parse("v1|tok|job%1|w1@node|123")
    assert old == Holder(task_id="job%1", hostname="w1@node", pid=123, token="tok")


def test_a_redlock_retrys_attempt_number_reads_as_the_same_holder():
    """``value|N``, stored by a Redlock's N-th attempt, names the same holder and fragment."""
    holder = Holder.new("t|1", "celery@w", ttl=5)
    value = holder.encode() + "|3"
    assert Holder.parse(value) == holder
    assert Holder.parse(value.encode()) == holder
    assert Holder.fragment("t|1", "celery@w") in value
    assert Holder.parse(holder.encode() + "|x") is None
