"""The locks page's SCAN paging against real servers: every lock once, filters, Redlock copies."""

from __future__ import annotations

from collections import Counter

import redis

from celery_redlock.core.fences import fence_key_for
from celery_redlock.core.holder import Holder
from celery_redlock.ops.web.detail import read_copies
from celery_redlock.ops.web.listing import Cursor, Filters, read_page
from celery_redlock.ops.web.metrics import count_keys


def key(prefix: str, task: str, n: int, reserved: bool = False) -> str:
    return f"{prefix}:v1:{{{task}:{n:064x}}}" + (":queued" if reserved else "")


def plant(client: redis.Redis, prefix: str = "web") -> dict[str, str]:
    """230 locks of two tasks in two queues, 20 reservations, the fence counter, unrelated keys."""
    planted = {}
    pipe = client.pipeline()
    for n in range(230):
        task = "app.alpha" if n % 2 else "app.beta"
        holder = Holder.new(f"t{n}", "w@h", ttl=60, queue="q1" if n % 3 else "q2")
        planted[key(prefix, task, n)] = holder.encode()
        pipe.set(key(prefix, task, n), holder.encode(), px=60_000)
    for n in range(20):
        planted[key(prefix, "app.alpha", 1000 + n, True)] = Holder.new(f"r{n}").encode()
        pipe.set(
            key(prefix, "app.alpha", 1000 + n, True),
            planted[key(prefix, "app.alpha", 1000 + n, True)],
        )
    pipe.set(fence_key_for(key(prefix, "app.beta", 0)), 230)
    pipe.set(f"{prefix}:unrelated", 1)
    pipe.set(f"other:v1:{{app.alpha:{0:064x}}}", 1)
    pipe.execute()
    return planted


def walk(nodes, prefixes, filters: Filters, size: int, budget: int = 50) -> tuple[list, int]:
    """Follow the pages to the end; return every row and the number of pages."""
    rows, cursor, pages = [], Cursor(), 0
    while True:
        page = read_page(nodes, prefixes, filters, cursor, size, budget)
        assert len(page.rows) <= size
        rows.extend(page.rows)
        pages += 1
        if page.next is None:
            return rows, pages
        cursor = page.next


def test_pages_list_every_lock_and_reservation_exactly_once(r: redis.Redis) -> None:
    """Paging by 50 yields each planted key once, the fence counter and other prefixes never."""
    planted = plant(r)
    rows, pages = walk([r], ["web"], Filters(), 50)
    assert Counter(info.key for info in rows) == Counter(list(planted))
    assert pages >= 5
    kinds = Counter(info.kind for info in rows)
    assert kinds == {"lock": 230, "reservation": 20}
    fenced = next(info for info in rows if info.key == key("web", "app.beta", 4))
    assert fenced.fence == 230 and fenced.holder is not None and fenced.holder.task_id == "t4"


def test_filters_narrow_by_task_queue_and_key_text(r: redis.Redis) -> None:
    """Task text, exact queue and key text each keep exactly the matching keys."""
    plant(r)
    beta, _ = walk([r], ["web"], Filters(task="beta"), 40)
    assert {info.task for info in beta} == {"app.beta"} and len(beta) == 115
    q2, _ = walk([r], ["web"], Filters(queue="q2"), 40)
    assert len(q2) == len([n for n in range(230) if n % 3 == 0])
    assert all(info.holder and info.holder.queue == "q2" for info in q2)
    text, _ = walk([r], ["web"], Filters(text=f"{7:064x}"), 40)
    assert [info.key for info in text] == [key("web", "app.alpha", 7)]
    nothing, pages = walk([r], ["web"], Filters(task="gamma"), 40)
    assert nothing == [] and pages == 1


def test_a_small_scan_budget_returns_short_pages_that_still_cover_everything(
    r: redis.Redis,
) -> None:
    """With one SCAN per request, a rare filter needs more pages but misses nothing."""
    plant(r)
    rows, pages = walk([r], ["web"], Filters(task="beta", queue="q2"), 10, budget=1)
    expected = {key("web", "app.beta", n) for n in range(0, 230, 2) if n % 3 == 0}
    assert {info.key for info in rows} == expected
    assert pages > len(expected) // 10


def test_redlock_masters_list_each_lock_once_and_show_their_copies(redis_servers) -> None:
    """A lock held on several masters is one row; each master's copy is read on its own."""
    nodes = [server.client() for server in redis_servers(3)]
    value = Holder.new("t", "w@h", ttl=60).encode()
    both = key("web", "app.alpha", 1)
    only_last = key("web", "app.alpha", 2)
    for node in nodes[:2]:
        node.set(both, value, px=60_000)
    nodes[2].set(only_last, value, px=60_000)
    rows, _ = walk(nodes, ["web"], Filters(), 50)
    assert sorted(info.key for info in rows) == sorted([both, only_last])
    copies = read_copies(nodes, both)
    assert [copy is not None for copy in copies] == [True, True, False]
    assert count_keys(nodes, ["web"]) == {("app.alpha", "lock"): 2}


def test_count_keys_counts_per_task_and_kind(r: redis.Redis) -> None:
    """The /metrics gauge counts keys by name alone: locks and reservations per task."""
    plant(r)
    assert count_keys([r], ["web"]) == {
        ("app.alpha", "lock"): 115,
        ("app.beta", "lock"): 115,
        ("app.alpha", "reservation"): 20,
    }
