"""The dashboard's rate rows read only what the page shows, however many rate keys exist."""

from __future__ import annotations

import hashlib

import pytest
import redis

from celery_redlock.core.rate import RateLimiter, parse_rate
from celery_redlock.ops.web import limits
from celery_redlock.ops.web.listing import Filters

pytestmark = pytest.mark.integration


def rate_key(task: str, n: int) -> str:
    return f"redlock:rate:v1:{{{task}:{hashlib.sha256(str(n).encode()).hexdigest()}}}"


def test_the_page_reads_a_batch_of_rate_keys_not_all_and_filters_by_name_first(
    r_decoded: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 rate keys in use, a page of 5: one batch is read and the page says there are
    more; a task filter reads only that task's keys."""
    limiter = RateLimiter(r_decoded, parse_rate("5/m"))
    for n in range(300):
        limiter.acquire(rate_key("bulk" if n else "single", n))
    read: list[str] = []
    real = limits.read_rates

    def counting(client: redis.Redis, keys: list[str]) -> list[object]:
        read.extend(keys)
        return real(client, keys)

    monkeypatch.setattr(limits, "read_rates", counting)
    page = limits.read_limits([r_decoded], ["redlock"], Filters(), 5)
    assert len(page.rates) == 5 and page.more
    assert len(read) < 300
    read.clear()
    page = limits.read_limits([r_decoded], ["redlock"], Filters(task="single"), 5)
    assert [row["task"] for row in page.rates] == ["single"] and not page.more
    assert read == [rate_key("single", 0)]
