"""The task path's shortcuts give exactly what the general code they bypass gives."""

from __future__ import annotations

import redis

from celery_redlock.celery.metrics import WAIT_BUCKETS, WaitTable
from celery_redlock.core.holder import Holder
from celery_redlock.core.keys import KeyBuilder
from celery_redlock.core.lock import Lock, fence_key_for
from celery_redlock.core.scripts import ACQUIRE, RELEASE


def test_a_lock_value_built_from_cached_fields_reads_back_like_an_encoded_holder():
    """Holder.new_value writes the fields Holder.new(...).encode() writes, escapes included."""
    cases = [
        ("1f3c", "celery@a", 30.0, "celery"),
        ("a|b%c", "node|x", None, None),
        ("id", None, 0.5, "q|1%"),
    ]
    for task_id, hostname, ttl, queue in cases:
        fast = Holder.parse(Holder.new_value(task_id, hostname, ttl=ttl, queue=queue))
        slow = Holder.parse(Holder.new(task_id, hostname, ttl=ttl, queue=queue).encode())
        assert fast is not None and slow is not None
        assert (fast.task_id, fast.hostname, fast.pid, fast.ttl_ms, fast.host, fast.queue) == (
            slow.task_id,
            slow.hostname,
            slow.pid,
            slow.ttl_ms,
            slow.host,
            slow.queue,
        )
        assert len(fast.token) == 32 and fast.token != slow.token


def test_script_packing_sends_the_bytes_redis_py_sends():
    """Script._pack gives the bytes redis-py packs for the same EVALSHA, and refuses the same."""
    connection = redis.Connection()
    calls = [
        (("k", "k:fence"), (b"token", 30000, 3600000, "0")),
        (("ключ",), ("é", 1.5, -3, 2**70)),
        ((), ()),
    ]
    for script in (ACQUIRE, RELEASE):
        for keys, args in calls:
            expected = b"".join(
                connection.pack_command("EVALSHA", script.sha, len(keys), *keys, *args)
            )
            assert script._pack(connection, keys, args) == expected
    for bad in (None, object()):
        try:
            ACQUIRE._pack(connection, ("k",), (bad,))
        except redis.DataError:
            pass
        else:
            raise AssertionError(f"{bad!r} was packed")


def test_a_locks_own_packing_sends_the_bytes_its_scripts_send():
    """A lock's acquire and release packed from kept parts are the bytes the scripts pack."""
    from celery_redlock.core.lock import Lock
    from celery_redlock.core.lock_wire import packed_acquire, packed_release
    from celery_redlock.core.scripts import RELEASE

    connection = redis.Connection()
    for name, ttl in (("k", 30), ("redlock:v1:{t:ключ}", None), ("", 0.5)):
        lock = Lock(redis.Redis(), name, timeout=ttl)
        token = b"v2|" + "é".encode() * 40
        args = (token, *lock._acquire_argv)
        packed = packed_acquire(name, lock.fence_key, token, lock._acquire_tail)
        assert packed == ACQUIRE._pack(connection, (name, lock.fence_key), args)
        released = packed_release(name, token)
        assert released == RELEASE._pack(connection, (name,), (token, b"0"))
        assert packed == b"".join(
            connection.pack_command("EVALSHA", ACQUIRE.sha, 2, name, lock.fence_key, *args)
        )
    # What the kept parts cannot tell as the scripts would, the scripts pack.
    assert packed_acquire(b"k", "f", b"t", b"") is None
    assert packed_release("k", "str token") is None


def test_positional_calls_key_like_bound_calls():
    """A call with positional arguments only keys like the same call by keyword, as bind keys it."""

    def plain(a, b):  # type: ignore[no-untyped-def]
        return None

    def with_default(a, b=2):  # type: ignore[no-untyped-def]
        return None

    keys = KeyBuilder("t", plain, None, "p")
    assert keys.key_for((1, [2, {"x": 1}]), {}) == keys.key_for((), {"a": 1, "b": [2, {"x": 1}]})
    assert keys.identity((1, 2), {}) == '{"a":1,"b":2}'
    defaults = KeyBuilder("t", with_default, None, "p")
    assert defaults.key_for((1,), {}) == defaults.key_for((1, 2), {}) == keys.key_for((1, 2), {})


def test_a_renamed_lock_keeps_the_options_and_starts_unheld():
    """Lock.renamed gives a lock on the new key with its fence key, label and callback, not held."""
    client = redis.Redis()  # never connected: nothing here sends a command
    template = Lock(client, "first", timeout=7, blocking=False, thread_local=False, label="a")
    renamed = template.renamed("second", on_lost=print, label="b")
    assert (renamed.name, renamed.fence_key, renamed.label) == (
        "second",
        fence_key_for("second"),
        "b",
    )
    assert renamed.on_lost is print and renamed.timeout == 7 and renamed.blocking is False
    assert renamed.local is not template.local and renamed.token is None and renamed.lease is None
    assert template.name == "first" and template.label == "a"


def test_an_observed_wait_lands_in_its_bucket_with_its_hold():
    """One observation adds to the bucket of the first bound at or above it, count, sum and hold."""
    table = WaitTable(["t"], processes=1)
    for seconds in (0.0, WAIT_BUCKETS[0], WAIT_BUCKETS[0] * 1.1, WAIT_BUCKETS[-1] * 2):
        table.observe("t", seconds, taken=True)
    wait, held = table.snapshot()
    assert wait["t"]["buckets"][:2] == [2, 3] and wait["t"]["buckets"][-1] == 4
    assert wait["t"]["buckets"][-2] == 3 and wait["t"]["count"] == 4
    assert held == {"t": 4}
