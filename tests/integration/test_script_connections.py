"""How scripts share connections: the reserved hot-path connection, threads and fork.

``Script`` keeps one pooled connection per process checked out for the hot
path. These tests would fail if two users ever interleaved on one socket (a
reply read by the wrong caller), if a forked child wrote on its parent's
socket, or if the reserved connection did not recover from a server restart.
"""

from __future__ import annotations

import errno
import os
import socket
import threading

import pytest
import redis

from celery_redlock.core.lock import Lock
from celery_redlock.core.lua import Script
from celery_redlock.core.reserved import reserved_for
from tests.redis_servers import RedisServer

# Returns its argument after a server-side busy loop long enough that two
# callers on one socket would overlap (and read each other's replies).
ECHO = Script(
    "echo",
    """
local n = 0
for i = 1, 2000 do n = n + i end
return ARGV[1]
""",
)


def _echo_many(client: redis.Redis, tag: str, count: int) -> list[str]:
    wrong = []
    for i in range(count):
        expected = f"{tag}-{i}".encode()
        reply = ECHO(client, [], [expected])
        if reply != expected:
            wrong.append(f"{expected!r} -> {reply!r}")
    return wrong


def test_threads_sharing_a_client_each_get_their_own_replies(redis_server: RedisServer) -> None:
    client = redis_server.client()
    wrong: list[str] = []
    threads = [
        threading.Thread(target=lambda tag=f"t{n}": wrong.extend(_echo_many(client, tag, 300)))
        for n in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []
    # The reserved connection plus at most one pooled connection per thread.
    pool = client.connection_pool
    assert len(pool._available_connections) + len(pool._in_use_connections) <= 9


def test_a_forked_child_does_not_use_its_parents_connection(redis_server: RedisServer) -> None:
    client = redis_server.client()
    assert _echo_many(client, "before-fork", 5) == []  # the parent reserves its connection
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: echo concurrently with the parent, report through the pipe
        status = 1
        try:
            os.close(read_fd)
            wrong = _echo_many(client, "child", 500)
            os.write(write_fd, ("\n".join(wrong) or "ok").encode()[:4000])
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    parent_wrong = _echo_many(client, "parent", 500)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_fd) as pipe:
        child_report = pipe.read()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert child_report == "ok"
    assert parent_wrong == []


def test_the_reserved_connection_reconnects_after_a_restart(redis_server: RedisServer) -> None:
    client = redis_server.client()
    assert ECHO(client, [], [b"first"]) == b"first"
    redis_server.restart()  # closes the reserved connection's socket, flushes the script cache
    assert ECHO(client, [], [b"second"]) == b"second"


# Returns ARGV[1] after keeping the server busy for ARGV[2] milliseconds.
SLOW_ECHO = Script(
    "slow_echo",
    """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local stop = now_ms() + tonumber(ARGV[2])
while now_ms() < stop do end
return ARGV[1]
""",
)


def test_a_timed_out_reply_is_never_read_as_the_next_calls(redis_server: RedisServer) -> None:
    """After a socket timeout the connection is dropped, so the late reply goes nowhere."""
    client = redis_server.client(socket_timeout=0.05)
    assert ECHO(client, [], [b"warm"]) == b"warm"  # the reserved connection is open
    try:
        SLOW_ECHO(client, [], [b"late", 300])
    except redis.TimeoutError:
        pass
    else:
        raise AssertionError("a 300 ms script answered within a 50 ms socket timeout")
    for _ in range(1000):  # the server answers again once the slow script is done
        try:
            reply = ECHO(client, [], [b"next"])
        except redis.TimeoutError:
            continue
        break
    assert reply == b"next"


def test_a_command_larger_than_the_socket_buffer_is_written_whole(
    redis_server: RedisServer,
) -> None:
    """A write that takes only part of a command hands the rest to ``sendall``.

    A small send buffer makes the first ``write()`` stop short; a command cut
    or sent twice would leave the server waiting or answering something else.
    """
    client = redis_server.client(socket_timeout=5)
    assert ECHO(client, [], [b"warm"]) == b"warm"  # the reserved connection is open
    reserved = reserved_for(client.connection_pool)
    assert reserved is not None and reserved.connection is not None
    reserved.connection._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    large = os.urandom(4 * 2**20)
    assert ECHO(client, [], [large]) == large
    assert ECHO(client, [], [b"after"]) == b"after"


def test_scripts_run_over_either_protocol(redis_server: RedisServer) -> None:
    """Replies of every shape read alike over RESP2 and RESP3 (redis-py 8's default)."""
    for protocol in (2, 3):
        client = redis_server.client(protocol=protocol)
        assert ECHO(client, [], [b"x" * 100_000]) == b"x" * 100_000  # longer than one read
        listing = Script("list", "return {1, ARGV[1], -2}")
        assert listing(client, [], ["a"]) == [1, b"a", -2]
        try:
            Script("fails", "return redis.error_reply('NOPE broken')")(client, [], [])
        except redis.ResponseError as exc:
            assert "broken" in str(exc)
        else:
            raise AssertionError("an error reply was not raised")
        assert ECHO(client, [], [b"after"]) == b"after"  # the connection is still in step


class _CountingConnection(redis.Connection):
    """A user's connection class that wraps the reading and the writing (instrumentation)."""

    reads = 0
    writes = 0

    def send_packed_command(self, command, check_health=True):  # type: ignore[no-untyped-def]
        type(self).writes += 1
        super().send_packed_command(command, check_health)

    def read_response(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        type(self).reads += 1
        return super().read_response(*args, **kwargs)


def test_a_connection_subclass_is_read_and_written_through_its_own_methods(
    redis_server: RedisServer,
) -> None:
    """Only redis-py's own connection classes are talked to directly; a subclass keeps its say."""
    pool = redis.ConnectionPool(
        connection_class=_CountingConnection, host="127.0.0.1", port=redis_server.port
    )
    client = redis.Redis(connection_pool=pool)
    _CountingConnection.reads = _CountingConnection.writes = 0
    assert _echo_many(client, "sub", 20) == []
    assert _CountingConnection.writes >= 20 and _CountingConnection.reads >= 20
    lock = Lock(client, "subclassed", timeout=10)
    assert lock.acquire(blocking=False)
    lock.release()
    assert _CountingConnection.reads >= 22


def test_a_lock_works_on_a_client_side_caching_client(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RESP3 client with a client-side cache hands out proxies without a socket of their own."""
    cache = pytest.importorskip("redis.cache")
    proxy = getattr(redis.connection, "CacheProxyConnection", None)
    if proxy is None:
        pytest.skip("this redis-py has no client-side caching")
    # redis-py turns the cache on from Redis 7.4; the tests' server may be older,
    # and its CLIENT TRACKING (Redis 6) is all the cache needs here.
    monkeypatch.setattr(proxy, "MIN_ALLOWED_VERSION", "6.0.0")
    client = redis_server.client(protocol=3, cache_config=cache.CacheConfig())
    assert client.set("cached", "1") and client.get("cached") == b"1"
    lock = Lock(client, "csc", timeout=10)
    assert lock.acquire(blocking=False)
    assert redis_server.client().get("csc") == lock.token
    lock.release()
    assert redis_server.client().get("csc") is None


class _DeadPeerSocket:
    """A socket whose reads fail as the kernel reports a dead peer (keepalive, TCP_USER_TIMEOUT)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)

    def recv_into(self, *args: object) -> int:
        raise OSError(errno.ETIMEDOUT, "Connection timed out")

    recv = recv_into


def test_a_dead_peer_is_a_connection_error_and_the_acquire_is_sent_again(
    redis_server: RedisServer,
) -> None:
    """``ETIMEDOUT`` is not a socket timeout: the acquire goes again on a new connection.

    A timeout is not retried (the server may be hung, see ``Script``), so
    reading ``ETIMEDOUT`` as one would leave the key set by the first send
    held by nobody until its TTL.
    """
    client = redis_server.client(socket_timeout=5)
    warm = Lock(client, "warm", timeout=10)
    assert warm.acquire(blocking=False)
    warm.release()
    connection = reserved_for(client.connection_pool).connection  # type: ignore[union-attr]
    connection._sock = _DeadPeerSocket(connection._sock)
    lock = Lock(client, "dead-peer", timeout=10)
    assert lock.acquire(blocking=False)
    assert redis_server.client().get("dead-peer") == lock.token
    lock.release()
    assert redis_server.client().get("dead-peer") is None
