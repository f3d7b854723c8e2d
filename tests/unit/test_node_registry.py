"""The registry that shares Redlock's nodes: bounded, least recently used first out."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import redis

from celery_redlock.core import nodes


@pytest.fixture
def url_pools(monkeypatch: pytest.MonkeyPatch) -> OrderedDict[str, object]:
    """An empty registry of URL pools for the test (node_for makes no connection)."""
    pools: OrderedDict[str, object] = OrderedDict()
    monkeypatch.setattr(nodes, "_url_pools", pools)
    return pools


def _url(i: int) -> str:
    return f"redis://127.0.0.1:{10000 + i}/0"


def test_master_urls_keep_a_bounded_number_of_pools(url_pools):
    """Past MAX_URL_POOLS URLs, the least recently used URL's pool is forgotten and closed."""
    first = nodes.node_for(_url(0), 0.1)
    first_pool = url_pools[_url(0)]
    closed: list[object] = []
    first_pool.disconnect = lambda *args, **kwargs: closed.append(first_pool)  # type: ignore[attr-defined]
    for i in range(1, nodes.MAX_URL_POOLS):
        nodes.node_for(_url(i), 0.1)
    # Used again: now the most recent, so the next URL pushes out _url(1).
    assert nodes.node_for(_url(0), 0.1) is first
    nodes.node_for(_url(nodes.MAX_URL_POOLS), 0.1)
    assert len(url_pools) == nodes.MAX_URL_POOLS
    assert _url(0) in url_pools and _url(1) not in url_pools
    assert closed == []
    for i in range(2, nodes.MAX_URL_POOLS + 1):
        nodes.node_for(_url(i), 0.1)
    nodes.node_for(_url(nodes.MAX_URL_POOLS + 1), 0.1)
    assert _url(0) not in url_pools
    assert closed == [first_pool]


def test_a_pool_keeps_a_bounded_number_of_nodes():
    """One node per node timeout, shared while remembered; past the bound the oldest goes."""
    client = redis.Redis(port=10000)
    timeouts = [0.05 + i / 100 for i in range(nodes.MAX_NODES_PER_POOL + 1)]
    made = [nodes.node_for(client, timeout) for timeout in timeouts]
    assert len(set(map(id, made))) == len(made)
    assert nodes.node_for(client, timeouts[-1]) is made[-1]
    assert len(nodes._nodes[client.connection_pool]) == nodes.MAX_NODES_PER_POOL
    # The first timeout's node was forgotten: a new one is made for it.
    assert nodes.node_for(client, timeouts[0]) is not made[0]
