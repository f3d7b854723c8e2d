"""The lock value carries its holder and round-trips through Redis's bytes."""

from __future__ import annotations

import os

from celery_redlock.holder import Holder


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
