"""The least a Python client can do for one acquire+release over N masters: the bench's floor.

No lock library: one pre-packed ``SET NX PX`` and one ``EVALSHA`` of a
compare-and-delete script, written to every master's socket with ``sendall``,
replies parsed by ``hiredis.Reader`` and waited for with ``poll()`` until a
majority answered (the rest are read before the next request to that master).
No timeouts, no error handling, no fences, no validity: whatever a real Redlock
client costs above this is its own; what this costs is the transport, the
servers and the machine.

With ``scripts=True`` (the "script floor") the same client sends
celery-redlock's own acquire script (``SET NX PX`` and a fence drawn from the
store's counter) and release script instead: the masters' work of a fenced
Redlock round, still without its client. Fences are not compared across
masters, so the second round trip a fenced Redlock makes when its masters'
counters disagree (rare once they are in step) is not in it.
"""

from __future__ import annotations

import secrets
import select
import socket
from collections.abc import Sequence

import hiredis
import redis
from lock_bench import RAW_RELEASE_LUA, TTL_MS, BenchError


class _Master:
    __slots__ = ("owed", "reader", "sock")

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()
        self.owed = 0


class FanoutFloor:
    """Acquire+release cycles over ``ports`` that wait for a majority, nothing more.

    Args:
        ports: Loopback ports of the masters.
        key: The lock key.
    """

    def __init__(self, ports: Sequence[int], key: str, scripts: bool = False) -> None:
        self.masters = [_Master(port) for port in ports]
        self.needed = len(self.masters) // 2 + 1
        self.by_fd = {m.sock.fileno(): m for m in self.masters}
        self.poll = select.poll()
        for fd in self.by_fd:
            self.poll.register(fd, select.POLLIN)
        sha = redis.Redis(port=ports[0]).script_load(RAW_RELEASE_LUA)
        for port in ports[1:]:
            redis.Redis(port=port).script_load(RAW_RELEASE_LUA)
        self.key = key.encode()
        self.sha = sha.encode() if isinstance(sha, str) else sha
        self.scripts = scripts
        if scripts:
            # Loaded the way any client would, then sent by SHA like the library.
            from celery_redlock.core.scripts import ACQUIRE, RELEASE

            for port in ports:
                client = redis.Redis(port=port)
                client.script_load(ACQUIRE.source)
                client.script_load(RELEASE.source)
                client.close()
            self.acquire_sha = ACQUIRE.sha.encode()
            self.release_sha = RELEASE.sha.encode()
            self.fence_key = self.key + b":fence"

    def _round(self, packed: bytes) -> int:
        """Send ``packed`` to every master; return how many of the first majority said 1/OK."""
        for master in self.masters:
            master.sock.sendall(packed)
            master.owed += 1
        answered = agreed = 0
        while answered < self.needed:
            for fd, _ in self.poll.poll():
                master = self.by_fd[fd]
                master.reader.feed(master.sock.recv(65536))
                while master.owed:
                    reply = master.reader.gets()
                    if reply is False:
                        break
                    master.owed -= 1
                    if master.owed == 0 and answered < self.needed:
                        answered += 1
                        # OK from SET NX, 1 from a release, a fence (> 0) from the script.
                        agreed += reply == b"OK" or (type(reply) is int and reply > 0)
        return agreed

    def cycle(self) -> None:
        """One acquire (SET NX PX) and one release (compare-and-delete) on a majority."""
        token = secrets.token_hex(16).encode()
        if self.scripts:
            acquire = hiredis.pack_command(
                (b"EVALSHA", self.acquire_sha, 2, self.key, self.fence_key, token, TTL_MS,
                 3_600_000, b"0")
            )  # fmt: skip
            release = (b"EVALSHA", self.release_sha, 1, self.key, token, b"0")
        else:
            acquire = hiredis.pack_command((b"SET", self.key, token, b"NX", b"PX", TTL_MS))
            release = (b"EVALSHA", self.sha, 1, self.key, token)
        if self._round(acquire) < self.needed:
            raise BenchError("the floor's uncontended acquire failed")
        self._round(hiredis.pack_command(release))

    def close(self) -> None:
        """Close the sockets."""
        for master in self.masters:
            master.sock.close()
