"""fair_countdown() and the line header: when a call waiting in line comes back, and its place."""

from __future__ import annotations

from types import SimpleNamespace

from celery_redlock.calls.decisions import Decision, decide, fair_countdown, requeues_charged
from celery_redlock.calls.options import LockOptions
from celery_redlock.celery.queueing import line_header
from celery_redlock.core.holder import Holder, Refusal

OPTIONS = LockOptions(requeue_delay=1.0, requeue_max_delay=60.0, requeue_jitter=0.0)


def in_line(rank: int, now_ms: int = 10_000, limit: int | None = None, ttl: float = 9.0) -> Refusal:
    return Refusal("v", ttl, limit=limit, rank=rank, waiting=rank + 1, arrival_us=1, now_ms=now_ms)


def test_the_next_call_polls_briefly_whatever_its_attempt():
    """The head of the line (or one of the first `limit`) comes back within a short poll."""
    assert fair_countdown(OPTIONS, 30, 0.0, in_line(0)) == 0.25
    assert fair_countdown(OPTIONS, 30, 0.0, in_line(2, limit=3)) == 0.25
    # No later than the holder's lease could end.
    assert fair_countdown(OPTIONS, 1, 0.0, in_line(0, ttl=0.1)) == 0.1 + 0.05


def test_a_call_further_back_never_sleeps_longer_than_a_delay_per_call_ahead():
    """Without a measure of the pace, the backoff is capped by `requeue_delay` per turn ahead."""
    assert fair_countdown(OPTIONS, 10, 0.0, in_line(3)) == 3.0
    assert fair_countdown(OPTIONS, 1, 0.0, in_line(3)) == 1.0


def test_a_call_further_back_comes_back_when_half_its_turns_should_have_passed():
    """Its rank moved from 10 to 6 in 2 s: 0.5 s a turn, 6 turns ahead -> back in 1.5 s."""
    refusal = in_line(6, now_ms=12_000)
    assert fair_countdown(OPTIONS, 5, 0.0, refusal, seen=(10, 10_000)) == 1.5
    # Capped by requeue_max_delay.
    slow = in_line(600, now_ms=12_000)
    assert fair_countdown(OPTIONS, 5, 0.0, slow, seen=(601, 10_000)) == 60.0


def test_line_header_keeps_the_oldest_arrival_and_the_own_runs_place():
    """A requeue carries [retries, arrival, rank, server ms]; a copy meeting its own dead run
    takes the arrival of that run's lock."""
    request = SimpleNamespace(retries=0)
    refusal = Refusal("v", 5.0, rank=2, waiting=4, arrival_us=5_000_000_000, now_ms=7)
    assert line_header(request, refusal, Decision("requeue")) == [0, 5_000_000_000, 2, 7]
    own = Holder.new("t", ttl=5.0)
    mine = Refusal(own.encode(), 5.0, rank=3, waiting=4, arrival_us=10**18, now_ms=9)
    header = line_header(request, mine, Decision("requeue", own=True))
    assert header == [0, own.acquired_ms * 1000, 3, 9]
    assert line_header(request, Refusal("v", 5.0), Decision("requeue")) is None


def waited(seconds: float, rank: int | None = 0) -> Refusal:
    """A refusal in line of a call that joined the line ``seconds`` ago."""
    now_ms = 1_000_000
    arrival_us = now_ms * 1000 - round(seconds * 1_000_000)
    return Refusal("v", 9.0, rank=rank, waiting=1, arrival_us=arrival_us, now_ms=now_ms)


def test_a_call_in_line_is_charged_the_requeues_its_wait_would_have_cost():
    """The next waiter polls four times a second: it is charged by its wait (the plain
    backoff's requeues in that time, 1+2+4+... s), not by its polls, so `max_requeues`
    does not run out behind a long holder sooner than without the line."""
    options = LockOptions(requeue_delay=1.0, requeue_max_delay=8.0, max_requeues=100)
    # 400 polls (100 s of waiting): 1+2+4 = 7 s, then 8 s each: 3 + (100 - 7) // 8 = 14.
    assert requeues_charged(options, 400, waited(100.0)) == 14
    assert requeues_charged(options, 400, waited(0.5)) == 0
    assert requeues_charged(options, 400, waited(3.0)) == 2
    assert requeues_charged(options, 400, waited(10_000.0)) == 100
    # Not in line: the requeues it made.
    assert requeues_charged(options, 7, waited(100.0, rank=None)) == 7
    # max_requeues=0 still gives up at the first conflict.
    none = LockOptions(max_requeues=0)
    assert decide(
        waited(0.0),
        "me",
        "requeue",
        requeues=requeues_charged(none, 0, waited(0.0)),
        max_requeues=0,
    ).gave_up
