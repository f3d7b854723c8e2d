"""What the benchmarks need to start their own redis-server processes."""

from __future__ import annotations

import os
import shutil
import socket


def redis_server_binary() -> str:
    """The redis-server to start: ``$REDLOCK_TEST_REDIS_SERVER``, else the one on PATH."""
    binary = os.environ.get("REDLOCK_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        raise RuntimeError("no redis-server: set REDLOCK_TEST_REDIS_SERVER or put it on PATH")
    return binary


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
