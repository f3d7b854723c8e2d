"""``celery redlock check`` runs the lock scripts on every master; store errors name their cause.

The command runs as operators run it, ``celery -A <app> redlock check`` in a
subprocess, against private servers: one Redis, Redlock masters, a Redis
Cluster and a Sentinel group, a Redis user whose ACL keeps it out of the key
prefix, and a TLS server whose certificate the client cannot verify.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_redlock import LockError, SingletonTask, singleton
from celery_redlock.celery.bootsteps import check_lock_store
from tests.redis_servers import LOOPBACK, RedisServer, RedisServerError, free_port
from tests.redis_topologies import MASTER_NAME, LocalCluster, LocalSentinel

REPO = Path(__file__).resolve().parents[2]
APP = "tests.celery_apps.cli_app"


def run_check(lock_url: Any, prefix: str, **settings: Any) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A tests.celery_apps.cli_app redlock check`` to completion."""
    if not isinstance(lock_url, str):  # a Redlock list goes in as a setting
        settings["redlock_url"] = lock_url
        lock_url = "redis://unused"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "REDLOCK_TEST_LOCK_URL": lock_url,
        "REDLOCK_TEST_PREFIX": prefix,
        "REDLOCK_TEST_SETTINGS": json.dumps(settings),
    }
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "redlock", "check"],
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def failure_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed check prints (nothing else on stdout or stderr)."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("celery-redlock: lock store ")
    return lines[0]


def passed(done: subprocess.CompletedProcess[str]) -> str:
    """The summary line of a check that passed."""
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stderr == ""
    summary, queues = done.stdout.splitlines()
    assert queues == "locked queues: (none)"
    return summary


def closed_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own."""
    return f"chk-{uuid.uuid4().hex[:8]}"


def test_check_runs_acquire_renew_and_release_and_leaves_nothing(redis_server, prefix):
    """On a working store the check runs the lock scripts under the prefix, then cleans up."""
    redis_server.reset_stats()
    summary = passed(run_check(redis_server.url, prefix))
    assert summary.startswith(f"lock store {redis_server.url} (Redis ")
    assert f"acquire, renew and release ran under {prefix}: on 127.0.0.1:" in summary
    calls = redis_server.commandstats()
    assert calls.get("evalsha", 0) + calls.get("eval", 0) >= 3, calls
    assert redis_server.client().keys("*") == []


def test_an_unreachable_store_fails_with_one_line_naming_the_cause(prefix):
    """Nothing listening: exit 1, one line on stderr with the connection error's reason."""
    url = f"redis://127.0.0.1:{closed_port()}/0"
    line = failure_line(run_check(url, prefix))
    assert f"lock store {url} failed the lock check: 127.0.0.1:" in line
    assert "is unreachable: ConnectionError: " in line
    assert "Connection refused" in line
    assert "network:ConnectionError" not in line


def test_a_user_the_acl_keeps_out_of_the_prefix_fails_the_check(redis_server, prefix):
    """An ACL user limited to ~other:* answers PING but may not lock: the check says so."""
    admin = redis_server.client()
    admin.acl_setuser(
        "locker", enabled=True, passwords=["+s3cret"], keys=["other:*"], commands=["+@all"]
    )
    url = f"redis://locker:s3cret@127.0.0.1:{redis_server.port}/0"
    line = failure_line(run_check(url, prefix))
    assert "refused the lock scripts: NoPermissionError: " in line
    assert "s3cret" not in line

    admin.acl_setuser("locker", enabled=True, reset_keys=True, keys=[f"{prefix}:*"])
    assert "acquire, renew and release ran" in passed(run_check(url, prefix))


def test_wrong_credentials_are_not_called_an_outage(redis_server, prefix):
    """A password the server refuses is reported as refused credentials, not as unreachable."""
    url = f"redis://nobody:wrong@127.0.0.1:{redis_server.port}/0"
    line = failure_line(run_check(url, prefix))
    assert "refused the credentials: AuthenticationError: " in line
    assert "unreachable" not in line


def test_redlock_fails_the_check_when_one_master_is_down(redis_servers, prefix):
    """Each Redlock master is probed; one that is down is named."""
    masters = redis_servers(3)
    urls = [master.url for master in masters]
    summary = passed(run_check(urls, prefix))
    assert all(f"127.0.0.1:{master.port}" in summary for master in masters)
    masters[1].stop()
    line = failure_line(run_check(urls, prefix))
    why = line.split(" failed the lock check: ", 1)[1]
    assert why.startswith(f"127.0.0.1:{masters[1].port} is unreachable: ConnectionError: ")
    assert f"127.0.0.1:{masters[0].port}" not in why


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_cluster_with_one_primary_down_fails_the_check(redis_server_binary, tmp_path, prefix):
    """Every Cluster primary is probed in its own slots; a dead one fails the check."""
    with LocalCluster(redis_server_binary, tmp_path / "cluster") as cluster:
        summary = passed(run_check(cluster.url, prefix))
        assert all(f"127.0.0.1:{node.port}" in summary for node in cluster.nodes)
        dead = cluster.nodes[2]
        dead.kill()
        line = failure_line(run_check(cluster.url, prefix))
        assert f"127.0.0.1:{dead.port} is unreachable" in line


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sentinel_store_is_checked_on_its_current_master(redis_server_binary, tmp_path, prefix):
    """The check asks the Sentinels for the master and runs the lock scripts there."""
    with LocalSentinel(redis_server_binary, tmp_path / "sentinel") as group:
        options = {"redlock_transport_options": {"master_name": MASTER_NAME}}
        summary = passed(run_check(group.url, prefix, **options))
        assert f"on 127.0.0.1:{group.master.port} (Sentinel master {MASTER_NAME!r})" in summary


# -- TLS: a store whose certificate the client cannot verify ----------------------------


class _TLSListener:
    """Serves TLS handshakes with ``cert`` and nothing else: a TLS port that is not Redis.

    Stands in for a Redis ``tls-port`` when the redis-server binary was built
    without TLS; the client fails the handshake either way, before any command.
    """

    def __init__(self, cert: Path, key: Path) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.sock = socket.create_server((LOOPBACK, 0))
        self.port = int(self.sock.getsockname()[1])
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            # The client refuses the certificate, as it should: the handshake fails.
            with closing(conn), contextlib.suppress(ssl.SSLError, OSError):
                self.context.wrap_socket(conn, server_side=True).close()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def tls_port(redis_server_binary: str, tmp_path: Path) -> Iterator[int]:
    """A TLS port with a self-signed certificate: a redis-server's ``tls-port`` if it has TLS."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is needed to make the test's self-signed certificate", pytrace=False)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={LOOPBACK}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    port = free_port()
    tls = (
        "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
    )  # fmt: skip
    server = RedisServer(redis_server_binary, workdir=tmp_path / "tls", extra_args=tls)
    try:
        server.start()
    except RedisServerError as exc:
        if "Bad directive" not in str(exc) and "TLS" not in str(exc):
            raise
        listener = _TLSListener(cert, key)  # a redis-server built without TLS
        try:
            yield listener.port
        finally:
            listener.close()
        return
    try:
        yield port
    finally:
        server.close()


def test_a_tls_store_without_its_ca_names_the_certificate_failure(tls_port, prefix):
    """The check's line carries the TLS error (CERTIFICATE_VERIFY_FAILED), not just a class name."""
    line = failure_line(run_check(f"rediss://127.0.0.1:{tls_port}/0", prefix))
    assert "is unreachable: ConnectionError: " in line
    assert "CERTIFICATE_VERIFY_FAILED" in line
    assert "(cause: SSLCertVerificationError" in line


def test_store_errors_in_logs_and_task_errors_carry_the_cause(tls_port, prefix, caplog):
    """The worker-start check, a run without the lock and a task's LockError all name the cause."""
    url = f"rediss://127.0.0.1:{tls_port}/0"
    app = Celery(f"tls-{prefix}", set_as_current=False)
    app.conf.update(broker_url="memory://", redlock_url=url, redlock_key_prefix=prefix)

    @app.task(base=SingletonTask, name=f"{prefix}.job", lock_on_redis_error="raise")
    def job() -> None:
        pass

    with caplog.at_level(logging.INFO):
        assert "CERTIFICATE_VERIFY_FAILED" in check_lock_store(app)
    with pytest.raises(LockError, match="CERTIFICATE_VERIFY_FAILED"):
        job.apply(throw=True).get()

    ran = []

    @singleton(url=url, on_redis_error="run")
    def refresh() -> None:
        ran.append(1)

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        refresh()
    assert ran == [1]
    assert "running WITHOUT the lock" in caplog.text
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text
    app.close()
