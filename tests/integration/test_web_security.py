"""The dashboard's protections, against the real ``celery redlock web`` process over HTTP.

Each test starts the command on a free loopback port with the storm app's
settings under a prefix of its own (Redis db 9, keys deleted afterwards) and
plants a lock whose holder is dead: a worker node that does not exist, on
this host, with the pid of a process that has exited. No worker is needed:
the ping of that node goes unanswered.
"""

from __future__ import annotations

import base64
import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_redlock.core.holder import Holder
from tests.celery_apps import storm
from tests.celery_harness import REDIS_URL, delete_prefixed_keys
from tests.processes import dead_pid
from tests.web_harness import Client, DashboardProcess, listening_addresses

pytestmark = pytest.mark.timeout(90)

APP_MODULE = "tests.celery_apps.storm"


@pytest.fixture
def prefix() -> str:
    return f"rlw-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def db9(prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        yield client
    finally:
        delete_prefixed_keys(client, prefix)
        client.close()


@pytest.fixture
def env(prefix: str) -> dict[str, str]:
    return storm.environment(
        broker=REDIS_URL, backend=REDIS_URL, lock_url=REDIS_URL, prefix=prefix, queue=f"{prefix}.q"
    )


@pytest.fixture
def dead_lock(db9: redis.Redis, prefix: str) -> tuple[str, str]:
    """A lock held by a dead process of a worker that does not exist: (key, value)."""
    key = f"{prefix}:v1:{{storm.hold:{'ab' * 32}}}"
    holder = Holder.new("task-of-the-dead", f"ghost-{prefix}@nowhere", ttl=60)
    value = Holder(**{**holder.__dict__, "pid": dead_pid()}).encode()
    db9.set(key, value, px=60_000)
    return key, value


def dashboard(env: dict[str, str], tmp_path: Path, *args: str) -> DashboardProcess:
    return DashboardProcess(APP_MODULE, env, ["--timeout", "0.5", *args], tmp_path / "logs")


def test_post_without_the_sessions_csrf_token_is_refused(
    env: dict[str, str], tmp_path: Path, db9: redis.Redis, dead_lock: tuple[str, str]
) -> None:
    """A release POST with no CSRF token, a wrong one or another session's changes nothing."""
    key, value = dead_lock
    with dashboard(env, tmp_path) as web:
        client = Client(web.url)
        token = client.request(f"/release?key={key}").csrf_token()
        form = {"key": key, "value": value}
        assert client.request("/release", form=form).status == 400
        assert client.request("/release", form={**form, "csrf_token": token + "x"}).status == 400
        stranger = Client(web.url)
        stranger.request(f"/release?key={key}")  # a session of its own
        refused = stranger.request("/release", form={**form, "csrf_token": token})
        assert refused.status == 400 and "CSRF" in refused.text
        assert db9.get(key) == value.encode()

        done = client.request("/release", form={**form, "csrf_token": token})
        assert done.status == 303
        assert db9.get(key) is None
        page = client.request("/")
        assert f"released {key}" in page.text and "is not running on this host" in page.text


def test_token_protects_every_page_and_metrics(
    env: dict[str, str], tmp_path: Path, db9: redis.Redis, dead_lock: tuple[str, str]
) -> None:
    """Without the token: login redirect, 401 for /metrics and POSTs; with it, all pages."""
    key, value = dead_lock
    secret = uuid.uuid4().hex
    with dashboard({**env, "REDLOCK_WEB_TOKEN": secret}, tmp_path) as web:
        client = Client(web.url)
        first = client.request("/")
        assert first.status == 302 and "/login" in first.headers["Location"]
        assert client.request("/metrics").status == 401
        assert client.request("/release", form={"key": key, "value": value}).status == 401
        bearer = {"Authorization": f"Bearer {secret}"}
        assert client.request("/metrics", headers=bearer).status == 200
        assert client.request("/", headers={"Authorization": "Bearer wrong"}).status == 302

        login = client.request("/login")
        assert login.status == 200
        token = login.csrf_token()
        wrong = client.request("/login", form={"token": "nope", "csrf_token": token, "next": "/"})
        assert wrong.status == 401
        assert client.request("/login", form={"token": secret, "next": "/"}).status == 400
        right = client.request("/login", form={"token": secret, "csrf_token": token, "next": "/"})
        assert right.status == 303
        page = client.request("/")
        assert page.status == 200
        assert "protected by a token (REDLOCK_WEB_TOKEN)" in page.text
        assert key in page.text
    assert db9.get(key) == value.encode()


def test_basic_auth_from_the_setting(
    env: dict[str, str], tmp_path: Path, dead_lock: tuple[str, str]
) -> None:
    """With redlock_web_basic_auth, a request without the credentials gets a Basic challenge."""
    settings = json.dumps({"redlock_web_basic_auth": "ops:s3cret"})
    with dashboard({**env, "REDLOCK_TEST_SETTINGS": settings}, tmp_path) as web:
        client = Client(web.url)
        refused = client.request("/")
        assert refused.status == 401
        assert refused.headers["WWW-Authenticate"].startswith("Basic ")
        wrong = base64.b64encode(b"ops:guess").decode()
        assert client.request("/", headers={"Authorization": f"Basic {wrong}"}).status == 401
        right = base64.b64encode(b"ops:s3cret").decode()
        page = client.request("/", headers={"Authorization": f"Basic {right}"})
        assert page.status == 200 and "HTTP basic auth (redlock_web_basic_auth)" in page.text


def test_read_only_offers_no_action_and_refuses_posts(
    env: dict[str, str], tmp_path: Path, db9: redis.Redis, dead_lock: tuple[str, str]
) -> None:
    """--read-only: no release button, the confirmation page and every POST refused."""
    key, value = dead_lock
    with dashboard(env, tmp_path, "--read-only") as web:
        client = Client(web.url)
        listing = client.request("/")
        assert listing.status == 200 and "read-only: no action can be taken" in listing.text
        detail = client.request(f"/lock?key={key}")
        assert detail.status == 200
        assert "release-form" not in detail.text and "Release" not in detail.text
        assert client.request(f"/release?key={key}").status == 403
        posted = client.request("/release", form={"key": key, "value": value, "csrf_token": "x"})
        assert posted.status == 403 and "read-only" in posted.text
    assert db9.get(key) == value.encode()


def test_listens_on_loopback_only_unless_asked(env: dict[str, str], tmp_path: Path) -> None:
    """By default only 127.0.0.1 listens, a foreign Host header is refused, and a
    non-loopback address with actions and no authentication is refused at start."""
    with dashboard(env, tmp_path) as web:
        assert listening_addresses(web.port) == {"127.0.0.1"}
        client = Client(web.url)
        assert client.request("/", headers={"Host": "attacker.example"}).status == 400
        assert client.request("/", headers={"Host": f"localhost:{web.port}"}).status == 200
    refused = dashboard(env, tmp_path, "--host", "0.0.0.0")
    with pytest.raises(RuntimeError, match="exited with 1") as info:
        refused.start()
    assert "without authentication" in str(info.value)


def test_the_port_is_free_again_after_the_dashboard_stops(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Stopping the dashboard (by its pid) closes its socket."""
    with dashboard(env, tmp_path) as web:
        port = web.port
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
