"""The guarded-call routine every integration drives, against a real redis-server.

run_guarded (and its asyncio twin) owns the order of events the guarantees
rest on: the lease is current exactly while the body runs, and the lock is
released in the body's finally, whatever the body did, before the caller
sees its outcome. A refusal reaches the guard through ``Lock.refusal``.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from celery_redlock import Lock, current_lock
from celery_redlock.asyncio import Lock as AsyncLock
from celery_redlock.calls.guarded import UNPROTECTED, Call, Guard, run_guarded
from celery_redlock.calls.guarded_async import run_guarded_async
from celery_redlock.core.holder import Holder

BODY_RESULT = "ran"


def new_call(key: str = "guarded:k", call_id: str = "call-1") -> Call:
    return Call(key, Holder.new(call_id).encode(), f"test[{call_id}]", call_id)


class Recorder(Guard[str]):
    """Records each hook, with what Redis held at that moment."""

    def __init__(self, client, lock_class=Lock, on_store_failure=UNPROTECTED):
        self.client = client
        self.lock_class = lock_class
        self.on_store_failure = on_store_failure
        self.events: list[str] = []
        self.refusals = []
        self.released_owned: list[bool] = []

    def new_lock(self, call):
        self.events.append("new_lock")
        return self.lock_class(self.client, call.key, timeout=30, blocking=False, auto_renew=True)

    def refused(self, call, lock):
        self.events.append("refused")
        self.refusals.append(lock.refusal)
        return "refused"

    def store_failed(self, call, exc):
        self.events.append(f"store_failed:{type(exc).__name__}")
        return self.on_store_failure

    def ran_unprotected(self, call):
        self.events.append("ran_unprotected")

    def acquired(self, call, lease):
        self.events.append("acquired")

    def starting(self, call, lease):
        assert current_lock() is lease
        self.events.append("starting")

    def release(self, call, lock, lease):
        self.events.append("release")
        owned = super().release(call, lock, lease)
        self.released_owned.append(owned)
        return owned


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_body_runs_between_acquire_and_release_with_its_lease_current(r):
    guard = Recorder(r)
    call = new_call()
    seen = {}

    def body():
        seen["lease"] = current_lock()
        seen["held"] = r.get(call.key)
        guard.events.append("body")
        return BODY_RESULT

    assert run_guarded(guard, call, body) == BODY_RESULT
    assert guard.events == ["new_lock", "acquired", "starting", "body", "release"]
    assert seen["held"] == call.token.encode()
    assert seen["lease"] is not None and seen["lease"].fence is not None
    assert r.exists(call.key) == 0  # released, not left to expire (30 s TTL)
    assert guard.released_owned == [True]
    assert current_lock() is None


def test_a_body_that_raises_still_releases_and_the_error_propagates(r):
    guard = Recorder(r)
    call = new_call()

    def body():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_guarded(guard, call, body)
    assert guard.events[-1] == "release"
    assert r.exists(call.key) == 0


def test_a_refused_call_never_runs_and_learns_who_holds_the_key(r):
    holder_guard = Recorder(r)
    refused_guard = Recorder(r)
    call = new_call(call_id="first")

    def body():
        second = new_call(call_id="second")
        outcome = run_guarded(refused_guard, second, lambda: pytest.fail("duplicate ran"))
        assert outcome == "refused"
        return BODY_RESULT

    assert run_guarded(holder_guard, call, body) == BODY_RESULT
    assert refused_guard.events == ["new_lock", "refused"]
    (refusal,) = refused_guard.refusals
    assert refusal.holder_id == "first"
    assert refusal.holder is not None and refusal.holder.task_id == "first"
    assert refusal.ttl is not None and 0 < refusal.ttl <= 30


def test_a_store_failure_can_run_the_body_unprotected_then_reports_it(caplog):
    # No retries: redis-py 8 retries a refused connection ten times with backoff
    # (about 4 s), which this test of the error would only wait out.
    client = redis.Redis(port=closed_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    guard = Recorder(client)
    ran = []
    assert run_guarded(guard, new_call(), lambda: ran.append(1) or BODY_RESULT) == BODY_RESULT
    assert ran == [1]
    assert guard.events == ["new_lock", "store_failed:ConnectionError", "ran_unprotected"]


def test_a_store_failure_outcome_other_than_unprotected_is_the_result():
    # No retries: redis-py 8 retries a refused connection ten times with backoff
    # (about 4 s), which this test of the error would only wait out.
    client = redis.Redis(port=closed_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    guard = Recorder(client, on_store_failure="gave up")
    assert run_guarded(guard, new_call(), lambda: pytest.fail("ran")) == "gave up"
    assert "ran_unprotected" not in guard.events


def test_a_lock_lost_during_the_body_is_reported_not_owned(r, caplog):
    guard = Recorder(r)
    call = new_call()

    def body():
        r.delete(call.key)  # an operator's purge, say
        return BODY_RESULT

    with caplog.at_level(logging.ERROR):
        assert run_guarded(guard, call, body) == BODY_RESULT
    assert guard.released_owned == [False]
    assert "was lost before the call finished" in caplog.text


def test_lock_refusal_is_empty_after_a_successful_acquire(r):
    first = Lock(r, "guarded:refusal", timeout=30)
    second = Lock(r, "guarded:refusal", timeout=30)
    assert first.acquire(blocking=False, token=Holder.new("one").encode())
    assert not second.acquire(blocking=False)
    assert second.refusal.holder_id == "one"
    first.release()
    assert second.acquire(blocking=False)
    assert second.refusal.value is None and second.refusal.ttl is None
    second.release()


def test_the_asyncio_twin_keeps_the_same_order_and_releases_on_error(redis_server):
    async def scenario():
        client = redis.asyncio.Redis(port=redis_server.port)
        try:
            guard = Recorder(client, lock_class=AsyncLock)
            call = new_call()

            async def body():
                guard.events.append("body")
                assert current_lock() is not None
                assert await client.get(call.key) == call.token.encode()
                raise KeyError("async boom")

            with pytest.raises(KeyError):
                await run_guarded_async(guard, call, body)
            assert guard.events == ["new_lock", "acquired", "starting", "body"]
            assert await client.exists(call.key) == 0

            holder = AsyncLock(client, "guarded:async", timeout=30)
            assert await holder.acquire(blocking=False, token=Holder.new("held").encode())
            refused = Recorder(client, lock_class=AsyncLock)

            async def never():
                pytest.fail("duplicate ran")

            outcome = await run_guarded_async(refused, new_call("guarded:async", "x"), never)
            assert outcome == "refused"
            assert refused.refusals[0].holder_id == "held"
            await holder.release()
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_release_errors_never_mask_the_outcome(r, caplog):
    call = new_call()

    class FailingRelease(Recorder):
        def new_lock(self, call):
            lock = super().new_lock(call)
            original = lock.release

            def release():
                original()
                raise RedisError("connection dropped after the release")

            lock.release = release
            return lock

    failing = FailingRelease(r)
    with caplog.at_level(logging.WARNING):
        assert run_guarded(failing, call, lambda: BODY_RESULT) == BODY_RESULT
    assert failing.released_owned == [True]
    assert "release failed" in caplog.text
