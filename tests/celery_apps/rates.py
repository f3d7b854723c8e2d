"""Tasks of the rate-limit tests (tests/integration/celery/test_rates.py).

Registered on the storm app by :func:`register`. ``rates.call`` is limited to
:data:`RATE` per account and records each execution with its admission time
on the Redis server's clock (``admitted_ms``), the time the window counts.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery, Task

from celery_redlock import SingletonTask, back_off, current_lock, current_rate
from celery_redlock.core.rate import backoff_key
from tests.celery_harness import record_execution

__all__ = ["RATE", "register"]

#: The rate of ``rates.call``: per account.
RATE = "20/s"


def register(app: Celery) -> None:
    """Add the rate-limited tasks to ``app``."""

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="rates.call",
        lock_rate=RATE,
        lock_rate_key=["account"],
        lock_on_conflict="requeue",
    )
    def call(
        self: Task, i: int, account: str, seconds: float = 0.0, pause_for: float | None = None
    ) -> Any:
        """Record the execution (with its admission time); back off the account if asked."""
        lease, slot = current_lock(), current_rate()
        if lease is None or slot is None:
            raise RuntimeError("rates.call runs without its lock or rate admission")
        client = slot.limiter.client
        with record_execution(
            client,
            self.app.conf.redlock_key_prefix,
            task_id=self.request.id,
            name=self.name,
            lease=lease,
            hostname=self.request.hostname,
        ) as recorder:
            recorder.extra["admitted_ms"] = slot.verdict.at_ms
            recorder.extra["rate_key"] = slot.key
            if pause_for is not None:
                back_off(pause_for)
                recorder.extra["blocked_until_ms"] = int(client.get(backoff_key(slot.key)))
            time.sleep(seconds)
        return i
