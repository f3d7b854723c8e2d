"""The private-Redis fixtures behave the way the rest of the suite relies on."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests import redis_servers
from tests.conftest import RedisServersFactory
from tests.redis_servers import RedisServer, RedisServerError

SHARED_REDIS_PORT = 6379


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _port_accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_server_answers_ping_on_a_private_port(redis_server: RedisServer, r: redis.Redis) -> None:
    """A fresh server answers PING on its own loopback port, never the shared 6379."""
    assert r.ping()
    assert redis_server.port != SHARED_REDIS_PORT
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redis_server.client().info("server")["process_id"] == redis_server.pid


def test_server_starts_empty_and_never_persists(r_decoded: redis.Redis) -> None:
    """A new server holds no keys and is configured to write nothing to disk."""
    assert r_decoded.dbsize() == 0
    assert r_decoded.config_get("save") == {"save": ""}
    assert r_decoded.config_get("appendonly") == {"appendonly": "no"}


def test_clients_decode_as_requested(r: redis.Redis, r_decoded: redis.Redis) -> None:
    """``r`` returns bytes and ``r_decoded`` returns str, on the same dataset."""
    r.set(b"greeting", b"hello")
    assert r.get(b"greeting") == b"hello"
    assert r_decoded.get("greeting") == "hello"


def test_unix_socket_reaches_the_same_server(redis_server: RedisServer, r: redis.Redis) -> None:
    """A client on the unix socket sees the data written over TCP."""
    r.set(b"k", b"v")
    assert redis_server.unix_client().get(b"k") == b"v"
    assert redis_server.unix_url.startswith("unix:///")


def test_restart_empties_data_and_keeps_the_port(redis_server: RedisServer, r: redis.Redis) -> None:
    """restart() comes back on the same port as a new process with an empty dataset."""
    r.set(b"k", b"v")
    port, pid = redis_server.port, redis_server.pid

    redis_server.restart()

    assert redis_server.port == port
    assert redis_server.pid != pid
    assert not _process_exists(pid)
    fresh = redis_server.client()
    assert fresh.dbsize() == 0
    assert fresh.get(b"k") is None


def test_pause_times_out_clients_and_resume_recovers(redis_server: RedisServer) -> None:
    """While paused the server answers nothing, so a 0.2 s socket timeout fires; resume heals it."""
    client = redis_server.client(socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
    assert client.ping()

    redis_server.pause()
    with pytest.raises(redis.TimeoutError):  # the socket timeout, nothing else, raises this
        client.ping()

    redis_server.resume()
    assert client.ping()


def test_stop_leaves_no_process_and_frees_the_port(redis_server: RedisServer) -> None:
    """After stop() the redis-server process is gone (reaped) and its port refuses connections."""
    pid, port = redis_server.pid, redis_server.port

    redis_server.stop()

    assert not redis_server.running
    assert not _process_exists(pid)
    assert not _port_accepts(port)


def test_stop_of_a_paused_server_is_prompt(redis_server: RedisServer) -> None:
    """stop() ends a SIGSTOPped server at once instead of waiting out its SIGKILL timeout."""
    pid = redis_server.pid
    redis_server.pause()
    stopper = threading.Thread(target=redis_server.stop, kwargs={"timeout": 60.0}, daemon=True)

    stopper.start()

    # Waiting out the SIGKILL timeout (60 s) could not end within this window.
    stopper.join(20)
    assert not stopper.is_alive()
    assert not _process_exists(pid)


def test_kill_ends_the_process_like_a_crash(redis_server: RedisServer) -> None:
    """kill() ends the server with SIGKILL and leaves no process behind."""
    pid = redis_server.pid

    redis_server.kill()

    assert not redis_server.running
    assert not _process_exists(pid)


def test_commandstats_counts_client_commands_only(
    redis_server: RedisServer, r: redis.Redis
) -> None:
    """After reset_stats(), commandstats() counts what clients sent, not the helper's own calls."""
    r.ping()  # finish the connection handshake before counting
    redis_server.reset_stats()
    assert redis_server.commandstats() == {}

    r.set(b"a", b"1")
    r.set(b"b", b"2")
    r.get(b"a")

    assert redis_server.commandstats() == {"get": 1, "set": 2}
    assert redis_server.commandstats() == {"get": 1, "set": 2}


def test_factory_starts_independent_servers(redis_servers: RedisServersFactory) -> None:
    """redis_servers(n) returns n running servers on distinct ports with separate datasets."""
    servers = redis_servers(3)

    assert len({server.port for server in servers}) == 3
    first, *others = (server.client() for server in servers)
    first.set(b"only-here", b"1")
    assert all(client.get(b"only-here") is None for client in others)


def test_factory_can_be_called_repeatedly(redis_cluster_nodes: RedisServersFactory) -> None:
    """Each call of the factory adds new servers without disturbing the earlier ones."""
    (first,) = redis_cluster_nodes(1)
    (second,) = redis_cluster_nodes(1)

    assert first.port != second.port
    assert first.running and second.running


def test_context_manager_stops_the_server(redis_server_binary: str, tmp_path: Path) -> None:
    """Leaving the with-block stops the server, so a forgotten server cannot outlive its test."""
    with RedisServer(redis_server_binary, workdir=tmp_path) as server:
        pid = server.pid
        assert server.client().ping()

    assert not _process_exists(pid)


def test_port_clash_moves_to_another_port(
    redis_server_binary: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If another process takes the chosen port before redis binds it, start() picks a new one."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real_free_port = redis_servers.free_port
        offers = iter([taken])
        monkeypatch.setattr(
            redis_servers, "free_port", lambda: next(offers, None) or real_free_port()
        )

        with RedisServer(redis_server_binary, workdir=tmp_path) as server:
            assert server.port != taken
            assert server.client().ping()
        assert "Address already in use" in server.log_path.read_text()


def test_start_failure_quotes_the_server_log(redis_server_binary: str, tmp_path: Path) -> None:
    """A server that cannot start raises RedisServerError quoting redis-server's own complaint."""
    server = RedisServer(
        redis_server_binary, workdir=tmp_path, extra_args=["--no-such-option", "1"]
    )

    with pytest.raises(RedisServerError, match="no-such-option"):
        server.start()
    assert not server.running
