"""The chaos suite's lock-window accounting finds unaccounted calls and extra waiting copies."""

from __future__ import annotations

from tests.chaos.windows import Call, most_waiting, published, unaccounted


def test_published_and_folded_calls_are_told_apart() -> None:
    """A call that got its own id back published; any other id means it was folded."""
    calls = [Call("r", "a", "a", 1.0), Call("r", "b", "a", 1.1), Call("r", "c", "c", 2.0)]
    assert [call.chosen for call in published(calls)] == ["a", "c"]
    assert unaccounted(calls) == []


def test_a_call_folded_into_an_unknown_copy_is_unaccounted() -> None:
    """Folded into a copy nobody published (or one of another resource): reported."""
    calls = [
        Call("r", "a", "a", 1.0),
        Call("s", "b", "a", 1.1),  # another resource's copy
        Call("r", "c", "ghost", 1.2),
        Call("r", "d", "e", 1.3),  # published only later
        Call("r", "e", "e", 1.4),
    ]
    found = unaccounted(calls)
    assert [line.split()[1] for line in found] == ["b", "c", "d"]


def test_copies_waiting_one_after_another_count_once() -> None:
    """Each copy is picked up before the next is published: one waiting at most."""
    calls = [Call("r", "a", "a", 1.0), Call("r", "b", "b", 2.0), Call("r", "c", "c", 3.0)]
    preruns = [("a", 1.5), ("b", 2.5), ("c", 3.5), ("a", 9.0)]  # a redelivered late
    assert most_waiting(calls, preruns) == {"r": 1}


def test_two_copies_waiting_at_once_are_found() -> None:
    """A copy published before the previous one was picked up makes two waiting."""
    calls = [Call("r", "a", "a", 1.0), Call("r", "b", "b", 1.2), Call("s", "c", "c", 1.1)]
    preruns = [("a", 1.5), ("b", 2.5), ("c", 1.15)]
    assert most_waiting(calls, preruns) == {"r": 2, "s": 1}


def test_a_copy_never_picked_up_waits_to_the_end() -> None:
    """No prerun at all: the copy waits for ever, overlapping every later one."""
    calls = [Call("r", "a", "a", 1.0), Call("r", "b", "b", 5.0)]
    assert most_waiting(calls, [("b", 6.0)]) == {"r": 2}


def test_a_copy_picked_up_before_its_publish_returned_never_waited() -> None:
    """The worker may start a copy before apply_async returns; it does not count."""
    calls = [Call("r", "a", "a", 1.0), Call("r", "b", "b", 2.0)]
    assert most_waiting(calls, [("a", 0.9), ("b", 2.5)]) == {"r": 1}
