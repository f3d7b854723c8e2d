"""singleton() protects plain and async functions: skip, raise, wait, renewal, 20 processes."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redlock import LockNotAcquired, current_lock, singleton
from tests.hold_log import assert_serial

FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"
SKIPPED = object()


def blocking_pair(client, ttl=5, **options):
    """A decorated function that holds its lock until ``release`` is set, and its events."""
    entered, release = threading.Event(), threading.Event()

    @singleton(client=client, ttl=ttl, skipped=SKIPPED, **options)
    def job(n):
        entered.set()
        assert release.wait(10)
        return n * 2

    return job, entered, release


def run_in_thread(fn, *args):
    box = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, box


def test_skip_returns_the_skipped_value_while_held(r):
    """A duplicate call under skip returns ``skipped`` without running; other keys run."""
    job, entered, release = blocking_pair(r, on_conflict="skip")
    thread, box = run_in_thread(job, 1)
    assert entered.wait(5)
    assert job(1) is SKIPPED
    release.set()
    assert job(2) == 4  # another key is free
    thread.join(5)
    assert box == {"result": 2}
    assert job(1) == 2  # free again once the first call returned
    assert all(key.endswith(b":fence") for key in r.keys("redlock:*"))  # no lock left


def test_raise_names_the_holder(r):
    """A duplicate call under raise gets LockNotAcquired naming the holding call."""
    job, entered, release = blocking_pair(r, on_conflict="raise")
    thread, _ = run_in_thread(job, 1)
    assert entered.wait(5)
    with pytest.raises(LockNotAcquired) as info:
        job(1)
    assert info.value.lock_name == job.lock_key_for(1)
    assert info.value.holder and 4 < info.value.holder_ttl <= 5
    release.set()
    thread.join(5)


def test_wait_runs_after_the_holder_and_times_out(r):
    """Under wait a duplicate runs once the holder finishes; past wait_timeout it raises."""
    job, entered, release = blocking_pair(r, on_conflict="wait", wait_timeout=5, wait_sleep=0.01)
    thread, _ = run_in_thread(job, 1)
    assert entered.wait(5)
    waiter, box = run_in_thread(job, 1)
    waiter.join(0.2)
    assert waiter.is_alive() and not box  # still waiting: the holder has not finished
    release.set()
    thread.join(5)
    waiter.join(5)
    assert box == {"result": 2}


def test_wait_timeout_raises(r, redis_server):
    """Past wait_timeout a waiting call raises LockNotAcquired; it retried every wait_sleep."""
    # The holder's TTL puts its first renewal (a script too) 20 s away.
    job, entered, release = blocking_pair(
        r, ttl=60, on_conflict="wait", wait_timeout=1.0, wait_sleep=0.05
    )
    thread, _ = run_in_thread(job, 1)
    assert entered.wait(5)
    redis_server.reset_stats()
    with pytest.raises(LockNotAcquired, match="within wait_timeout"):
        job(1)
    calls = redis_server.commandstats()
    # Each retry follows a 0.05 s sleep, so no more than 1 + 1.0 / 0.05 attempts
    # fit into wait_timeout, however slow the machine; at least one retry does
    # unless the first round trip alone took 0.95 s.
    assert 2 <= calls.get("evalsha", 0) + calls.get("eval", 0) <= 21
    release.set()
    thread.join(5)


def test_current_lock_renewal_and_release_on_error(r):
    """Inside the call current_lock() is the renewed lease; an exception still releases it."""
    seen = {}

    @singleton(client=r, ttl=0.6)
    def slow(x):
        lease = current_lock()
        seen["fence"] = lease.fence
        time.sleep(1.5)  # well past the TTL: only renewal keeps the key
        seen["renewals"] = lease.renewals
        seen["held"] = r.get(lease.name) == lease.token
        raise ValueError(x)

    with pytest.raises(ValueError):
        slow(1)
    assert seen["fence"] and seen["renewals"] >= 2 and seen["held"]
    assert r.get(slow.lock_key_for(1)) is None
    assert current_lock() is None


def test_on_redis_error_run_runs_unprotected_and_raise_raises(redis_server, caplog):
    """With the lock store down, "run" runs the function (WARNING) and "raise" raises."""
    # No retries: redis-py 8 retries a refused connection ten times with backoff
    # (about 4 s), which this test of the error would only wait out.
    client = redis_server.client(socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    redis_server.stop()
    fail_open = singleton(lambda: "ran", client=client, on_redis_error="run", name="open")
    # At the logger itself: an in-process worker run earlier leaves the root at ERROR.
    with caplog.at_level(logging.WARNING, logger="celery_redlock"):
        assert fail_open() == "ran"
    assert "running WITHOUT the lock" in caplog.text
    fail_closed = singleton(lambda: "ran", client=client, name="closed")
    with pytest.raises(redis.exceptions.ConnectionError):
        fail_closed()


def test_async_function_skip_raise_and_wait(redis_server):
    """An async def function gets the asyncio lock: skip, raise and wait behave as for def."""

    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_server.url)
        entered, release = asyncio.Event(), asyncio.Event()

        async def body(n):
            entered.set()
            await release.wait()
            assert current_lock() is not None
            return n * 2

        skip = singleton(body, client=client, skipped=SKIPPED, name="same")
        fail = singleton(body, client=client, on_conflict="raise", name="same")
        wait = singleton(body, client=client, on_conflict="wait", wait_sleep=0.01, name="same")
        first = asyncio.ensure_future(skip(1))
        await entered.wait()
        assert await skip(1) is SKIPPED
        with pytest.raises(LockNotAcquired):
            await fail(1)
        waiter = asyncio.ensure_future(wait(1))
        done, _ = await asyncio.wait({waiter}, timeout=0.1)
        assert not done
        release.set()
        assert await first == 2 and await waiter == 2
        assert not await client.exists(skip.lock_key_for(1))
        await client.aclose()

    asyncio.run(scenario())


def test_async_function_releases_when_it_raises_or_is_cancelled(redis_server):
    """An async call that raises, or is cancelled while it holds the lock, releases it at once."""

    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_server.url)
        entered = asyncio.Event()

        # A TTL far beyond the test: a key that is gone was released, it did not expire.
        @singleton(client=client, ttl=60)
        async def body(how):
            entered.set()
            if how == "raise":
                raise ValueError(how)
            await asyncio.Event().wait()  # until cancelled

        with pytest.raises(ValueError):
            await body("raise")
        assert not await client.exists(body.lock_key_for("raise"))

        entered.clear()
        call = asyncio.ensure_future(body("cancel"))
        await entered.wait()
        assert await client.exists(body.lock_key_for("cancel"))
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # CancelledError is no Exception: only a release in the call's finally runs for it.
        assert not await client.exists(body.lock_key_for("cancel"))
        assert current_lock() is None
        await client.aclose()

    asyncio.run(scenario())


def test_async_function_with_url_gets_a_client_per_loop(redis_server):
    """With url=, an async function works across separate asyncio.run() calls."""

    @singleton(url=redis_server.url, ttl=0.6)
    async def renewed():
        lease = current_lock()
        await asyncio.sleep(1.0)
        return lease.renewals

    assert asyncio.run(renewed()) >= 1
    assert asyncio.run(renewed()) >= 1


# -- 20 processes --------------------------------------------------------------------


def make_guarded(url):
    @singleton(url=url, ttl=2, on_conflict="wait", wait_sleep=0.002, name="shared-resource")
    def guarded(log_key):
        client = redis.Redis.from_url(url)
        start = time.time()
        holders = client.incr("holders")
        time.sleep(0.005)
        client.decr("holders")
        client.rpush(log_key, f"{start}:{time.time()}:{holders}:{current_lock().fence}")

    return guarded


def make_async_guarded(url):
    @singleton(url=url, ttl=2, on_conflict="wait", wait_sleep=0.002, name="shared-resource")
    async def guarded(log_key):
        client = redis.asyncio.Redis.from_url(url)
        start = time.time()
        holders = await client.incr("holders")
        await asyncio.sleep(0.005)
        await client.decr("holders")
        await client.rpush(log_key, f"{start}:{time.time()}:{holders}:{current_lock().fence}")
        await client.aclose()

    return guarded


def call_repeatedly(url, rounds, use_async, done):
    try:
        if use_async:
            guarded = make_async_guarded(url)

            async def main():
                for _ in range(rounds):
                    await guarded("log")

            asyncio.run(main())
        else:
            guarded = make_guarded(url)
            for _ in range(rounds):
                guarded("log")
        done.put("ok")
    except BaseException as exc:
        done.put(repr(exc))


@pytest.mark.filterwarnings(FORK_WARNING)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_async", [False, True], ids=["def", "async-def"])
def test_twenty_processes_never_overlap(redis_server, use_async):
    """One decorated function called from 20 processes: the interval log has no overlap."""
    ctx = multiprocessing.get_context("fork")
    done = ctx.Queue()
    processes = [
        ctx.Process(target=call_repeatedly, args=(redis_server.url, 5, use_async, done))
        for _ in range(20)
    ]
    for process in processes:
        process.start()
    outcomes = [done.get(timeout=100) for _ in processes]
    for process in processes:
        process.join(timeout=10)
    assert outcomes == ["ok"] * 20
    assert_serial(redis_server.client(), "log", 100)
