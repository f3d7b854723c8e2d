"""decide(): what a refused call does, the rules every integration shares."""

from __future__ import annotations

import pytest

from celery_redlock.calls.decisions import (
    Decision,
    decide,
    gave_up,
    not_acquired,
    requeue_countdown,
)
from celery_redlock.calls.options import LockOptions
from celery_redlock.core.holder import Holder, Refusal

HELD_BY_A = Refusal(Holder.new("a").encode(), 4.0)


@pytest.mark.parametrize(
    ("policy", "call_id", "requeues", "can_requeue", "expected"),
    [
        ("skip", "b", 0, True, Decision("skip")),
        ("raise", "b", 0, True, Decision("raise")),
        ("wait", "b", 0, True, Decision("raise")),  # a wait that ran out
        ("requeue", "b", 0, True, Decision("requeue")),
        ("requeue", "b", 2, True, Decision("raise", gave_up=True)),
        ("requeue", "b", 0, False, Decision("raise")),
        # The holder is this very call (a redelivery): wait for it, whatever the policy.
        ("skip", "a", 0, True, Decision("requeue", own=True)),
        ("raise", "a", 5, True, Decision("requeue", own=True)),
        ("requeue", "a", 99, True, Decision("requeue", own=True)),
        ("skip", None, 0, True, Decision("skip")),
    ],
)
def test_decide(policy, call_id, requeues, can_requeue, expected):
    decision = decide(
        HELD_BY_A, call_id, policy, requeues=requeues, max_requeues=2, can_requeue=can_requeue
    )
    assert decision == expected


def test_an_unknown_holder_is_never_taken_for_the_call_itself():
    assert decide(Refusal(), None, "skip") == Decision("skip")
    assert decide(Refusal(), "a", "skip") == Decision("skip")


def test_an_own_holder_is_waited_for_at_most_its_ttl():
    options = LockOptions(requeue_delay=30.0, requeue_max_delay=60.0, requeue_jitter=0.0)
    own = decide(HELD_BY_A, "a", "skip")
    assert requeue_countdown(options, 1, 0.0, own, HELD_BY_A) == pytest.approx(4.1)
    other = decide(HELD_BY_A, "b", "requeue", max_requeues=5)
    assert requeue_countdown(options, 1, 0.0, other, HELD_BY_A) == 30.0


def test_errors_name_the_holder_and_the_key():
    error = not_acquired("task t[b]", "k", HELD_BY_A, "task")
    assert str(error).startswith("task t[b] not run: task a (on ")
    assert error.holder == "a" and error.holder_ttl == 4.0 and error.lock_name == "k"
    unreachable = ConnectionError("down")
    exhausted = gave_up("task t[b]", "k", 3, Refusal(), unreachable)  # type: ignore[arg-type]
    assert "gave up after 3 requeues: the lock store kept failing for k" in str(exhausted)
    assert exhausted.__cause__ is unreachable
