"""The sliding-window rate limiter against a real redis-server: exact windows, waits, back-off."""

from __future__ import annotations

import threading

import pytest

from celery_redlock.core.rate import RATE_ACQUIRE, Rate, RateLimiter, backoff_key, rate_keys_of

pytestmark = pytest.mark.timeout(30)


def starts_per_window(starts: list[int], window_ms: int) -> int:
    """The most starts any half-open interval of ``window_ms`` holds."""
    ordered = sorted(starts)
    most = 0
    for i, start in enumerate(ordered):
        inside = [s for s in ordered[i:] if s < start + window_ms]
        most = max(most, len(inside))
    return most


def test_the_limit_admits_n_then_refuses_with_the_exact_wait(r):
    """N calls start; the next is refused with the time until the oldest leaves the window."""
    limiter = RateLimiter(r, Rate(3, 10.0))
    admitted = [limiter.acquire("rate:{k}", f"c{i}") for i in range(3)]
    assert all(v.admitted for v in admitted)
    assert [v.used for v in admitted] == [1, 2, 3]
    refused = limiter.acquire("rate:{k}", "c3")
    assert not refused.admitted and not refused.backed_off
    (_, oldest), *_ = r.zrange("rate:{k}", 0, 0, withscores=True)
    now_s, now_us = r.time()
    now_ms = now_s * 1000 + now_us // 1000
    # Refused at a server time between the last admission and now: the wait
    # ends exactly when the oldest start leaves the window.
    wait_ms = refused.wait * 1000
    assert oldest + 10_000 - now_ms <= wait_ms <= oldest + 10_000 - admitted[2].at_ms


def test_no_window_ever_holds_more_than_the_limit_under_contention(r):
    """Eight threads hammering one key for 1.5 s: every 200 ms interval holds at most 5 starts."""
    limiter = RateLimiter(r, Rate(5, 0.2))
    starts: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            verdict = limiter.acquire("rate:{hot}")
            if verdict.admitted:
                with lock:
                    starts.append(verdict.at_ms)
            else:
                stop.wait(min(verdict.wait, 0.01))

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    stop.wait(1.5)
    stop.set()
    for thread in threads:
        thread.join(5)
    assert len(starts) >= 20  # the limiter admitted calls all along
    assert starts_per_window(starts, 200) <= 5


def test_a_refund_frees_the_slot(r):
    """An admission given back (its lock was refused) lets the next call in at once."""
    limiter = RateLimiter(r, Rate(1, 60.0))
    first = limiter.acquire("rate:{r}")
    assert first.admitted
    assert not limiter.acquire("rate:{r}").admitted
    limiter.refund("rate:{r}", first)
    assert limiter.acquire("rate:{r}").admitted


def test_back_off_refuses_every_call_of_the_key_until_it_ends(r):
    """A back-off blocks its rate key (even with slots free), and only that key."""
    limiter = RateLimiter(r, Rate(100, 1.0))
    assert limiter.back_off("rate:{api}", 30.0) == pytest.approx(30.0, abs=0.01)
    refused = limiter.acquire("rate:{api}")
    assert not refused.admitted and refused.backed_off
    assert 29.0 < refused.wait <= 30.0
    assert limiter.acquire("rate:{other}").admitted
    # A shorter back-off does not shorten the longer one.
    assert limiter.back_off("rate:{api}", 1.0) > 29.0
    assert r.pttl(backoff_key("rate:{api}")) > 29_000


def test_back_off_ends(r):
    """After the back-off passes, calls are admitted again."""
    limiter = RateLimiter(r, Rate(100, 1.0))
    limiter.back_off("rate:{short}", 0.05)
    refused = limiter.acquire("rate:{short}")
    assert not refused.admitted
    threading.Event().wait(refused.wait + 0.01)
    assert limiter.acquire("rate:{short}").admitted


def test_a_resent_admission_finds_its_own_entry(r):
    """After a lost reply the resend is admitted by the first send's entry, not counted twice."""
    keys = rate_keys_of("rate:{re}")
    first = RATE_ACQUIRE(r, keys, (1, 60_000, "m1", "0"))
    again = RATE_ACQUIRE(r, keys, (1, 60_000, "m1", "1"))
    assert first[0] == 1 and again[0] == 1 and again[1] == first[1]
    assert r.zcard("rate:{re}") == 1
    assert RATE_ACQUIRE(r, keys, (1, 60_000, "m2", "1"))[0] == 0


def test_usage_reports_use_and_waits_without_changing_them(r):
    """The operator's view: used/limit, time until a slot frees, back-off left."""
    limiter = RateLimiter(r, Rate(2, 60.0))
    assert limiter.usage("rate:{u}") == (0, 0.0, 0.0)
    limiter.acquire("rate:{u}")
    limiter.acquire("rate:{u}")
    used, wait, blocked = limiter.usage("rate:{u}")
    assert used == 2 and 59.0 < wait <= 60.0 and blocked == 0.0
    assert limiter.usage("rate:{u}")[0] == 2
