"""Redlock when a master runs requests out of the order they were sent in.

A master runs one connection's commands in order, but two connections' in
whatever order their bytes arrive. These tests make late bytes (a delaying
proxy, a paused server) and check that no late request undoes a later one.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import redis

from celery_redlock import Redlock
from celery_redlock.core.holder import Holder
from celery_redlock.core.nodes import MAX_JOBS, bounded_client, node_for
from celery_redlock.core.through_client import ThroughClient, Unanswered
from celery_redlock.core.volley import Volley
from celery_redlock.core.wire import Request
from tests.fault_proxy import DelayProxy
from tests.integration.test_redlock import wait_until, warm


@pytest.mark.timeout(30)
def test_late_undo_of_a_failed_attempt_leaves_the_next_attempts_grant(redis_servers):
    """A retry's grant survives the previous attempt's release arriving after it."""
    first, second, third = redis_servers(3)
    name = "job"
    with DelayProxy(third.port) as proxy:
        masters = [first.client(), second.client(), redis.Redis(port=proxy.port)]
        lock = Redlock(masters, name, timeout=10, node_timeout=0.05)
        warm(lock)
        # The second master refuses for 1.5 s: the first attempt needs the third.
        second.client().set(name, "someone else", px=1500)
        started = time.monotonic()
        # The first attempt's acquire, and the release behind it, reach the third
        # master 0.8 s late; the retry goes out on a new connection, on time.
        proxy.hold(started + 0.8)
        stop = threading.Timer(0.07, proxy.stop_holding)
        stop.start()
        try:
            assert lock.acquire(blocking=True, sleep=0.2, blocking_timeout=3)
        finally:
            stop.join()
        assert time.monotonic() < started + 0.8, "the retry came too late to race the undo"
        time.sleep(max(0.0, started + 1.0 - time.monotonic()))
        # The late release must not have deleted the retry's grant.
        assert third.client().get(name) == lock.token
        assert wait_until(lambda: second.client().get(name) is None, timeout=2)
        other = Redlock(masters, name, timeout=10)
        assert not other.acquire(blocking=False), "two holders at once"
        lock.release()


@pytest.mark.timeout(30)
def test_retries_store_values_of_their_own_that_still_name_the_holder(redis_servers):
    """Each attempt stores its own value; a Holder value still parses and is released by holder."""
    servers = redis_servers(3)
    clients = [s.client() for s in servers]
    lock = Redlock(clients, "job", timeout=10)
    warm(lock)
    for client in clients[:2]:
        client.set("job", "someone else", px=300)
    holder = Holder.new("task-1", "celery@here", ttl=10, queue="q")
    value = holder.encode().encode()
    assert lock.acquire(token=value, sleep=0.1, blocking_timeout=3)
    stored = lock.token
    assert stored is not None and stored != value and stored.startswith(value + b"|")
    assert clients[2].get("job") == stored
    assert Holder.parse(stored) == holder
    lock.release()
    assert wait_until(lambda: all(c.get("job") is None for c in clients))


@pytest.mark.timeout(60)
def test_release_through_a_client_runs_after_its_acquire(redis_servers):
    """On a master reached through its client (RESP3), a release never overtakes its acquire."""
    servers = redis_servers(3)
    resp3 = servers[2].client(protocol=3)
    masters = [servers[0].client(), servers[1].client(), resp3]
    names = [f"job{n}" for n in range(60)]
    for name in names:
        lock = Redlock(masters, name, timeout=30)
        assert lock.acquire(blocking=False)
        lock.release()
    check = servers[2].client()
    assert wait_until(lambda: not any(check.exists(name) for name in names), timeout=3), [
        name for name in names if check.exists(name)
    ]


@pytest.mark.timeout(30)
def test_acquire_timed_out_through_a_client_is_still_undone(redis_servers):
    """An acquire a hung master runs after the client gave up on it is released after it."""
    servers = redis_servers(3)
    masters = [servers[0].client(), servers[1].client(), servers[2].client(protocol=3)]
    lock = Redlock(masters, "job", timeout=30, node_timeout=0.2)
    warm(lock)
    # The second master refuses and the third hangs: the attempt fails.
    servers[1].client().set("job", "someone else", px=60000)
    servers[2].pause()
    try:
        assert not lock.acquire(blocking=False)
        # The client's socket timeout (the node timeout) passes while it is hung.
        time.sleep(0.5)
    finally:
        servers[2].resume()
    check = servers[2].client()
    assert wait_until(lambda: check.get("job") is None, timeout=3), check.get("job")
    assert servers[0].client().get("job") is None


def sets_run(server):
    """How many ``SET`` (an acquire without fencing) ``server`` ran since its stats were reset."""
    return server.commandstats().get("set", 0)


def warm_awaiting_all(lock, first):
    """:func:`warm` ``lock`` with ``first`` holding its key for someone else.

    Every vote then needs the other masters' answers, so none of their
    requests is still on its way (or queued on the thread pool) afterwards.
    """
    first.client().set(lock.name, "someone else")
    warm(lock)
    first.client().delete(lock.name)


@pytest.mark.timeout(30)
def test_undo_of_an_acquire_timed_out_through_a_client_goes_behind_it(redis_servers):
    """On a master reached through its client, an acquire that timed out is undone after it runs.

    The acquire's bytes reach the master late; the undo, sent once the
    client gave up on the acquire, reaches it at once on any other
    connection, and would run first: the late acquire would then hold the key
    until its TTL. Sent behind the acquire on its connection, it runs second.
    """
    first, second, third = redis_servers(3)
    with DelayProxy(third.port) as proxy:
        masters = [first.client(), second.client(), redis.Redis(port=proxy.port, protocol=3)]
        lock = Redlock(masters, "job", timeout=30, node_timeout=0.2, fencing=False)
        warm_awaiting_all(lock, first)
        # The second master refuses: the attempt needs the third, which is late.
        second.client().set("job", "someone else", px=60000)
        third.reset_stats()
        # What the third master's open connections carry from now on reaches
        # it 1 s late; connections opened later pass at once.
        proxy.hold(time.monotonic() + 1.0, only_open=True)
        assert not lock.acquire(blocking=False)
        # The acquire has reached the third master and run there.
        assert wait_until(lambda: sets_run(third) == 1, timeout=5)
        check = third.client()
        assert wait_until(lambda: check.get("job") is None, timeout=3), check.get("job")
        # The connection that carried both serves the next attempts, their
        # replies read first: with the first master taken, each vote waits
        # for the third's own answer.
        first.client().set("job", "someone else")
        second.client().delete("job")
        for _ in range(2):
            assert lock.acquire(blocking=False), lock.local.failure
            assert check.get("job") == lock.token
            lock.release()
            assert check.get("job") is None


@pytest.mark.timeout(30)
def test_release_after_an_acquire_timed_out_through_a_client_goes_behind_it(redis_servers):
    """On a master reached through its client, a release runs after an acquire that timed out.

    The lock is won without the late master; its release, sent there once the
    client gave up on the acquire, would overtake the acquire on any other
    connection and leave the key until its TTL.
    """
    first, second, third = redis_servers(3)
    with DelayProxy(third.port) as proxy:
        masters = [first.client(), second.client(), redis.Redis(port=proxy.port, protocol=3)]
        lock = Redlock(masters, "job", timeout=30, node_timeout=0.2, fencing=False)
        warm_awaiting_all(lock, first)
        third.reset_stats()
        proxy.hold(time.monotonic() + 1.0, only_open=True)
        assert lock.acquire(blocking=False), lock.local.failure
        lock.release()
        # The acquire has reached the third master and run there.
        assert wait_until(lambda: sets_run(third) == 1, timeout=5)
        check = third.client()
        assert wait_until(lambda: check.get("job") is None, timeout=3), check.get("job")


@pytest.mark.timeout(30)
def test_shared_lock_released_by_another_thread_behind_its_acquires_stragglers(redis_servers):
    """A lock shared by threads, released by another thread before a slow master answered
    its acquire: the release runs after the acquire there, and every later vote reads its own
    replies."""
    first, second, slow = redis_servers(3)
    name = "job"
    with DelayProxy(slow.port) as proxy:
        masters = [first.client(), second.client(), redis.Redis(port=proxy.port)]
        lock = Redlock(masters, name, timeout=10, thread_local=False)
        warm(lock)
        # This thread's own connection to every master (the one a thread
        # keeps, see core/lanes.py), which the acquire below then goes out
        # on: a thread-local lock's votes that need the slow master's answer
        # (the first master is taken) give it one.
        # (Retried: a connection that opens after a vote carries no acquire.)
        first.client().set("warm", "someone else")
        warmer = Redlock(masters, "warm", timeout=10)
        for _ in range(3):
            assert warmer.acquire(blocking_timeout=3), warmer.local.failure
            warmer.release()
        first.client().delete("warm")
        # The acquire reaches the slow master 0.6 s late: the vote is won
        # without it, and its connection still owes that reply.
        late = time.monotonic() + 0.6
        proxy.hold(late)
        assert lock.acquire(blocking=False)
        proxy.stop_holding()
        fence = lock.fence
        released = {}

        def release():
            lock.release()
            released["at"] = time.monotonic()

        other_thread = threading.Thread(target=release)
        other_thread.start()
        other_thread.join(5)
        # Released by a majority before the slow master even saw the acquire.
        assert released["at"] < late, "the release waited for the slow master"
        assert first.client().get(name) is None and second.client().get(name) is None
        # A release sent on another connection would run first there and leave
        # the late acquire's key behind; sent behind it, it deletes it.
        time.sleep(max(0.0, late + 0.2 - time.monotonic()))
        assert wait_until(lambda: slow.client().get(name) is None, timeout=2), slow.client().get(
            name
        )
        # Later votes, from both threads, each read their own replies: with
        # the first master taken, each needs the slow master's own answer (a
        # connection whose count of owed replies went wrong would take an
        # earlier reply for it, or wait for one that never comes).
        first.client().set(name, "someone else")
        fences = [fence]
        rival = Redlock(masters, name, timeout=10)
        for _ in range(3):
            for run in (lambda f: f(), lambda f: run_in_thread(f)):

                def cycle():
                    assert lock.acquire(blocking=False), lock.local.failure
                    fences.append(lock.fence)
                    assert lock.locked() and lock.owned()
                    assert not rival.acquire(blocking=False)
                    lock.release()

                run(cycle)
        assert fences == sorted(set(fences)), fences
        assert first.client().delete(name) == 1
        assert not lock.locked()
        assert all(c.get(name) is None for c in (first.client(), second.client(), slow.client()))


def run_in_thread(call):
    """Run ``call`` in a new thread and return once it has; its exception is raised here."""
    errors = []

    def target():
        try:
            call()
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


@pytest.mark.timeout(30)
def test_a_round_made_while_another_waits_on_the_same_lanes_reads_only_its_own_replies(
    redis_servers, monkeypatch
):
    """Two rounds at once on one thread's lanes: neither takes the other's replies.

    Greenlets share a thread's lanes when gevent patched after this library
    was imported (a preloading server): one greenlet's round then starts while
    another's waits for its replies. Here the second round runs at exactly
    that point of the first, in the same thread. Were the lanes left free
    while a reply is on its way, the second round would send on them too, read
    the first round's replies as earlier ones nobody waits for, and leave the
    first one waiting for replies already taken: its acquire would fail with
    its keys set on every master.
    """
    servers = redis_servers(3)
    masters = [s.client() for s in servers]
    first = Redlock(masters, "first", timeout=10, node_timeout=0.5)
    second = Redlock(masters, "second", timeout=10, node_timeout=0.5)
    warm(first)
    warm(second)
    count = Volley._count
    interleaved: list[bool] = []

    def count_after_another_round(self, *args):
        if not interleaved:
            # What another greenlet does while this round waits in poll().
            taken = second.acquire(blocking=False)
            interleaved.append(taken)
            if taken:
                second.release()
        return count(self, *args)

    monkeypatch.setattr(Volley, "_count", count_after_another_round)
    # A round goes out as a volley once the thread's lanes are all ready.
    for _ in range(20):
        assert first.acquire(blocking=False), first.local.failure
        if interleaved:
            break
        first.release()
    assert interleaved == [True], "no round went out as a volley, or the second failed"
    check = [s.client() for s in servers]
    assert [c.get("first") for c in check] == [first.token] * 3
    first.release()
    assert wait_until(lambda: all(c.get("first") is None for c in check), timeout=3)
    assert all(c.get("second") is None for c in check)


class Interrupted(BaseException):
    """Stands for a signal handler's or a time limit's exception (not an ``Exception``)."""


@pytest.mark.timeout(30)
def test_a_round_interrupted_while_waiting_leaves_its_lanes_to_the_next_rounds(
    redis_servers, monkeypatch
):
    """A signal or time limit raised while a round waits: the lanes owe, and serve again.

    The interrupted round's replies stay owed on the thread's connections and
    are read first by the next round on them; left marked busy, the lanes
    would never carry a round of this thread again (every later round would
    take other connections, and the owed replies would never be read).
    """
    servers = redis_servers(3)
    masters = [s.client() for s in servers]
    first = Redlock(masters, "first", timeout=10)
    second = Redlock(masters, "second", timeout=10)
    warm(first)
    warm(second)
    count = Volley._count
    volleys: list[str] = []

    def count_or_interrupt(self, *args):
        if not volleys:
            volleys.append("interrupted")
            raise Interrupted  # arrives while the replies are on their way
        volleys.append("counted")
        return count(self, *args)

    monkeypatch.setattr(Volley, "_count", count_or_interrupt)
    # A round goes out as a volley once the thread's lanes are all ready.
    for _ in range(20):
        try:
            assert first.acquire(blocking=False), first.local.failure
            first.release()
        except Interrupted:
            break
    assert volleys == ["interrupted"]
    lanes = first._masters.lanes()
    # Free, and owing the interrupted round's reply (behind any a round
    # before it left unread).
    assert [(lane.busy, lane.owed >= 1) for lane in lanes] == [(False, True)] * 3
    for _ in range(3):
        assert second.acquire(blocking=False), second.local.failure
        second.release()
    # (Under load a round may still take the general path: its replies came
    # later than the node timeout.)
    assert "counted" in volleys, volleys


@pytest.mark.timeout(60)
def test_a_connection_kept_owing_replies_to_a_silent_peer_is_given_up(redis_servers):
    """A long-lived lock's kept connection whose peer went silent (no reset) is given up.

    The connections open to the third master (reached through its client)
    stop carrying bytes, as with a host lost behind a name or a firewall that
    dropped them, while new connections reach it. Once the first master is
    taken, every vote needs the third: a lock still queueing its key's
    requests behind the silent connection would never win one again.
    """
    first, second, third = redis_servers(3)
    with DelayProxy(third.port) as proxy:
        masters = [first.client(), second.client(), redis.Redis(port=proxy.port, protocol=3)]
        lock = Redlock(masters, "job", timeout=30, node_timeout=0.2, fencing=False)
        warm(lock)
        proxy.hold(time.monotonic() + 40.0, only_open=True)
        # Won without the third master, whose acquire (and then release) waits
        # on the silent connection, kept for the key.
        assert lock.acquire(blocking=False)
        lock.release()
        first.client().set("job", "someone else")

        def acquired() -> bool:
            if not lock.acquire(blocking=False):
                time.sleep(0.2)
                return False
            lock.release()
            return True

        assert wait_until(acquired, timeout=15), lock.local.failure


@pytest.mark.timeout(60)
def test_the_follow_up_of_a_late_request_goes_behind_it_however_long_it_was_kept(redis_servers):
    """An acquire sent behind a kept connection late in its window, then its undo: the undo
    goes behind it there too, so a hung master that resumes runs the acquire first."""
    (server,) = redis_servers(1)
    node_timeout = 0.2
    through = ThroughClient(bounded_client(server.client(), node_timeout), node_timeout)
    through.run(Request(("PEXPIRE", "job", 1)))  # a connection in the pool
    server.pause()
    try:
        with pytest.raises(Unanswered):
            through.run(Request(("PEXPIRE", "job", 60_000)))  # kept, owing its reply
        with pytest.raises(Unanswered):
            through.run(Request(("SET", "job", "token-a", "PX", 60_000)))  # behind it
        through._owing["job"].give_up = time.monotonic() - 1  # the window has passed
        with pytest.raises(Unanswered):  # sent behind both, not on a new connection
            through.run(Request.release("job", b"token-a").following())
    finally:
        server.resume()
    check = server.client()
    assert wait_until(lambda: check.get("job") is None, timeout=3), check.get("job")


@pytest.mark.timeout(60)
def test_a_follow_up_runs_though_its_master_has_every_job_slot_taken(redis_servers):
    """A hung master reached through its client fills its job slots, and further requests are
    refused at once; the undo of a request already sent still runs, behind it."""
    (server,) = redis_servers(1)
    node = node_for(server.client(protocol=3), 1.0)
    node.start(Request(("SET", "job", "token-a", "PX", 60_000))).result()  # a connection
    server.pause()
    try:
        jobs = [node.start(Request(("SET", "job", "token-a", "PX", 60_000)))]
        jobs += [node.start(Request(("SET", f"other{i}", "x"))) for i in range(MAX_JOBS - 1)]
        with pytest.raises(redis.ConnectionError):
            node.start(Request(("SET", "another", "x")))
        jobs.append(node.start(Request.release("job", b"token-a").following()))
    finally:
        server.resume()
    concurrent.futures.wait(jobs, timeout=10)
    check = server.client()
    assert wait_until(lambda: check.get("job") is None, timeout=3), check.get("job")
