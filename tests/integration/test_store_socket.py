"""A lock store named with kombu's unix-socket URL forms reaches the server over its socket."""

from __future__ import annotations

import pytest

from celery_redlock.core.store import LockStore, parse_store


@pytest.mark.timeout(30)
@pytest.mark.parametrize("scheme", ["redis+socket", "socket"])
def test_kombus_socket_broker_url_locks_over_the_unix_socket(redis_server, scheme):
    """``broker_url = redis+socket:///path`` (or ``socket://``) locks on that socket's server."""
    url = f"{scheme}://{redis_server.unix_socket_path}?virtual_host=3"
    store = LockStore(parse_store({"broker_url": url}))
    lock = store.lock("job", timeout=10)
    assert lock.acquire(blocking=False)
    assert redis_server.client(db=3).get("job") == lock.token
    lock.release()
    assert redis_server.client(db=3).get("job") is None
