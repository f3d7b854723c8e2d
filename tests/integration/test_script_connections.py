"""How scripts share connections: the reserved hot-path connection, threads and fork.

``Script`` keeps one pooled connection per process checked out for the hot
path. These tests would fail if two users ever interleaved on one socket (a
reply read by the wrong caller), if a forked child wrote on its parent's
socket, or if the reserved connection did not recover from a server restart.
"""

from __future__ import annotations

import os
import threading

import redis

from celery_redlock.core.lua import Script
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
