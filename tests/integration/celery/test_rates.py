"""Rate limits against real workers: the history never shows more starts per window than allowed.

Two prefork workers with four processes each take calls of ``rates.call``,
limited to 20 per second per account; calls over the limit requeue until a
slot frees. The history records each execution with its admission time on the
Redis server's clock, the clock the window is kept on. Throughput is measured
in bench/rate_bench.py, not here.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import pytest
from celery import Celery

from tests.celery_harness import History
from tests.integration.celery.test_storms import wait_for_states

if TYPE_CHECKING:
    from tests.integration.celery.conftest import WorkerFactory

pytestmark = pytest.mark.slow

CALLS = 300
LIMIT, WINDOW_MS = 20, 1000


def most_starts_in_a_window(starts: list[int], window_ms: int) -> int:
    """The most starts any half-open interval of ``window_ms`` holds."""
    ordered = sorted(starts)
    most, first = 0, 0
    for last, start in enumerate(ordered):
        while ordered[first] <= start - window_ms:
            first += 1
        most = max(most, last - first + 1)
    return most


@pytest.mark.timeout(240)
def test_a_rate_of_20_per_second_holds_across_two_workers_and_loses_nothing(
    storm_app: Celery, worker_factory: WorkerFactory, history: History
) -> None:
    """300 calls on one rate key: every call runs once; no second holds more than 20 starts."""
    worker_factory.start(worker_factory.create("prefork", 4), worker_factory.create("prefork", 4))
    call = storm_app.tasks["rates.call"]
    with call.app.producer_or_acquire() as producer:
        ids = [call.apply_async((i, "acct"), producer=producer).id for i in range(CALLS)]
    states = wait_for_states(storm_app, ids, {"SUCCESS", "FAILURE"}, timeout=180)
    assert Counter(state for state, _ in states.values()) == {"SUCCESS": CALLS}
    executions = [e for e in history.executions() if e.name == "rates.call"]
    assert sorted(e.task_id for e in executions) == sorted(ids), "a call ran twice or never"
    admitted = [e.extra["admitted_ms"] for e in executions]
    assert most_starts_in_a_window(admitted, WINDOW_MS) <= LIMIT
    assert len({e.extra["rate_key"] for e in executions}) == 1


@pytest.mark.timeout(120)
def test_a_back_off_reported_by_a_task_delays_every_call_of_its_rate_key(
    storm_app: Celery, worker_factory: WorkerFactory, history: History
) -> None:
    """After a call backs off its account for 2 s, no call of that account starts before the end."""
    worker_factory.start(worker_factory.create("prefork", 4))
    call = storm_app.tasks["rates.call"]
    first = call.apply_async((0, "slow-api"), kwargs={"pause_for": 2.0})
    assert first.get(timeout=30) == 0
    ids = [call.apply_async((i, "slow-api")).id for i in range(1, 11)]
    other = call.apply_async((0, "other-api")).id
    states = wait_for_states(storm_app, [*ids, other], {"SUCCESS", "FAILURE"}, timeout=60)
    assert Counter(state for state, _ in states.values()) == {"SUCCESS": 11}
    by_id = {e.task_id: e for e in history.executions()}
    blocked_until = by_id[first.id].extra["blocked_until_ms"]
    assert all(by_id[i].extra["admitted_ms"] >= blocked_until for i in ids)
    assert by_id[other].extra["rate_key"] != by_id[first.id].extra["rate_key"]


def test_the_window_count_is_exact() -> None:
    """The checker's own arithmetic: half-open windows, as the limiter keeps them."""
    assert most_starts_in_a_window([0, 999, 1000, 1999], 1000) == 2
    assert most_starts_in_a_window([0, 1, 2, 1001], 1000) == 3
    assert most_starts_in_a_window([], 1000) == 0
