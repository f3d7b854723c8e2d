"""Watchdog scheduling with a fake clock: batching, retries and loss, without sleeping.

The client here is a recording stand-in: these tests check when and with what
the watchdog calls Redis, not what the Lua does (the integration tests do that
against a real server).
"""

from __future__ import annotations

import pytest

from celery_redlock import Lease, Watchdog


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakePool:
    """Stands in for a connection pool: something the watchdog can group by."""


class RecordingClient:
    """Answers the renew script as a server holding every lock would, or fails on demand."""

    def __init__(self) -> None:
        self.connection_pool = FakePool()  # leases on one pool are batched together
        self.connection = self  # a single-connection client: scripts use execute_command
        self.calls: list[list[str]] = []
        self.error: Exception | None = None
        self.not_owned: set[str] = set()

    def execute_command(self, command, sha, numkeys, *keys_and_args):
        keys = list(keys_and_args[:numkeys])
        self.calls.append(keys)
        if self.error is not None:
            raise self.error
        args = keys_and_args[numkeys + 1 :]
        return [0 if key in self.not_owned else int(args[2 * i + 1]) for i, key in enumerate(keys)]


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def client():
    return RecordingClient()


@pytest.fixture
def watchdog(clock):
    dog = Watchdog(clock=clock)
    dog._thread = _NeverStarted()  # drive passes by hand with renew_due()
    return dog


class _NeverStarted:
    def is_alive(self) -> bool:
        return True


def lease(client, clock, name, ttl=3.0, **kwargs):
    return Lease(
        client=client,
        name=name,
        token=b"t",
        fence=1,
        ttl=ttl,
        sent_at=clock(),
        clock=clock,
        **kwargs,
    )


def test_leases_due_close_together_share_one_call(watchdog, client, clock):
    """Leases acquired within half a renewal interval are renewed in one command."""
    leases = []
    for i in range(5):
        leases.append(lease(client, clock, f"k{i}"))
        watchdog.watch(leases[-1])
        clock.now += 0.1  # acquired 0.1 s apart; interval is 1 s
    clock.now = 100.0 + 1.0
    watchdog.renew_due()
    assert client.calls == [[f"k{i}" for i in range(5)]]
    assert all(item.renewals == 1 for item in leases)


def test_clients_without_a_pool_renew_each_lease_alone(watchdog, clock):
    """A Cluster client has no pool and cannot run one script over many slots."""

    class ClusterLike(RecordingClient):
        def __init__(self) -> None:
            super().__init__()
            del self.connection_pool

    client = ClusterLike()
    for i in range(3):
        watchdog.watch(lease(client, clock, f"k{i}"))
    clock.now += 1.0
    watchdog.renew_due()
    assert sorted(client.calls) == [["k0"], ["k1"], ["k2"]]


def test_nothing_is_sent_before_leases_are_due(watchdog, client, clock):
    """A pass before anything is half way due sends nothing."""
    watchdog.watch(lease(client, clock, "k"))
    clock.now += 0.4
    watchdog.renew_due()
    assert client.calls == []


def test_failed_renewal_is_retried_then_lost_at_the_deadline(watchdog, client, clock):
    """Errors (even non-Redis ones) keep the lease watched until its validity runs out."""
    lost = []
    item = lease(client, clock, "k", on_lost=lost.append)
    watchdog.watch(item)
    client.error = RuntimeError("broken connection class")
    attempts = 0
    while not item.lost and attempts < 100:
        clock.now += 0.1
        watchdog.renew_due()
        attempts += 1
    assert item.lost and lost == [item]
    assert "renewed" in item.loss_reason
    assert len(client.calls) >= 5  # retried, not dropped after the first failure
    assert clock.now >= item.deadline


def test_recovery_before_the_deadline_keeps_the_lease(watchdog, client, clock):
    """A transient error followed by a good renewal leaves the lease held."""
    item = lease(client, clock, "k")
    watchdog.watch(item)
    client.error = ConnectionError("blip")
    clock.now += 1.0
    watchdog.renew_due()
    client.error = None
    for _ in range(20):
        clock.now += 0.1
        watchdog.renew_due()
    assert not item.lost
    assert item.renewals >= 1


def test_not_owned_is_lost_at_once(watchdog, client, clock):
    """A renewal that finds another value marks only that lease lost."""
    mine, stolen = lease(client, clock, "mine"), lease(client, clock, "stolen")
    watchdog.watch(mine)
    watchdog.watch(stolen)
    client.not_owned.add("stolen")
    clock.now += 1.0
    watchdog.renew_due()
    assert stolen.lost and not mine.lost


def test_released_and_expired_leases_are_not_sent(watchdog, client, clock):
    """Released leases are dropped; a lease already past its validity is lost, not renewed."""
    released, stale = lease(client, clock, "released"), lease(client, clock, "stale")
    watchdog.watch(released)
    watchdog.watch(stale)
    released.released = True
    clock.now += 10.0  # the process slept past every deadline
    watchdog.renew_due()
    assert client.calls == []
    assert stale.lost and "validity expired" in stale.loss_reason
    assert not released.lost


def test_a_large_batch_is_chunked(clock):
    """More leases than the batch size go out in several script calls."""

    class PipelineClient(RecordingClient):
        def pipeline(self, transaction=True):
            outer = self

            class Pipe:
                def __init__(self):
                    self.queued = []

                def execute_command(self, *args):
                    self.queued.append(args)

                def execute(self, raise_on_error=True):
                    return [outer.execute_command(*args) for args in self.queued]

            return Pipe()

    client = PipelineClient()
    dog = Watchdog(clock=clock, batch_size=10)
    dog._thread = _NeverStarted()
    for i in range(25):
        dog.watch(lease(client, clock, f"k{i}"))
    clock.now += 1.0
    dog.renew_due()
    assert [len(keys) for keys in client.calls] == [10, 10, 5]


# The first thread dies of its exception, on purpose.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_watchdog_whose_thread_ended_starts_another(client, clock) -> None:
    """A renewal thread that died is replaced by the next watch(), not left dead."""
    dog = Watchdog(clock=clock)
    passes: list[str] = []

    def fatal_pass() -> None:
        passes.append("fatal")
        raise SystemExit  # not an Exception: the loop does not survive it

    dog.renew_due = fatal_pass  # type: ignore[method-assign]
    dog.watch(lease(client, clock, "first"))
    first = dog._thread
    assert first is not None
    first.join(timeout=10)
    assert not first.is_alive() and passes == ["fatal"]

    dog.renew_due = lambda: passes.append("second")  # type: ignore[method-assign]
    dog.watch(lease(client, clock, "second"))
    second = dog._thread
    assert second is not None and second is not first
    for _ in range(1000):  # the new thread makes its first pass at once
        if "second" in passes:
            break
        second.join(timeout=0.01)
    assert passes[:2] == ["fatal", "second"]


def test_a_failed_thread_start_is_tried_again_by_the_next_watch(client, clock, monkeypatch):
    """A start that fails (a thread limit) leaves no thread behind that the next watch() trusts.

    Otherwise every later lease would wait for renewals from a thread that
    never ran, and expire at its TTL while its holder still runs.
    """
    import threading

    dog = Watchdog(clock=clock)
    dog.renew_due = lambda: None  # type: ignore[method-assign]
    real_start = threading.Thread.start
    failures = [RuntimeError("can't start new thread")]

    def start(thread: threading.Thread) -> None:
        if thread.name == "celery-redlock-watchdog" and failures:
            raise failures.pop()
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    first = lease(client, clock, "first")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        dog.watch(first)
    assert dog.watched() == 0  # the failed watch took nothing on
    dog.watch(lease(client, clock, "second"))
    assert dog._thread is not None and dog._thread.is_alive()
    assert dog.watched() == 1
