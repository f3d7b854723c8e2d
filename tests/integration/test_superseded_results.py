"""``get()`` on a ``SUPERSEDED`` result, against a real result backend (db 9 of the shared Redis).

States are written straight into the backend, as workers write them, so the
shapes a worker can leave behind (a chain of replacements, two copies naming
each other for a moment, a replacement that is never named) are set up
without timing. Task ids are fresh uuids, so nothing meets another test's
records; each test deletes its own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.exceptions import TimeoutError as ResultTimeout

from celery_redlock import SUPERSEDED, DuplicateSkipped
from celery_redlock.celery.result import SingletonResult
from tests.celery_harness import REDIS_URL

_ids: list[str] = []


@pytest.fixture
def app() -> Iterator[Celery]:
    """An app whose result backend is db 9; it publishes nothing."""
    app = Celery("superseded", broker="memory://", backend=REDIS_URL, set_as_current=False)
    yield app
    for task_id in _ids:
        app.backend.forget(task_id)
    _ids.clear()
    app.close()


def _id(name: str) -> str:
    _ids.append(f"{name}-{uuid.uuid4()}")
    return _ids[-1]


def _supersede(app: Celery, task_id: str, by: str | None) -> None:
    app.backend.store_result(task_id, {"by": by, "key": "k"}, SUPERSEDED)


@pytest.mark.timeout(30)
def test_get_follows_a_chain_of_replacements_to_the_run(app: Celery) -> None:
    """a -> b -> c: a's get() returns c's result."""
    a, b, c = _id("a"), _id("b"), _id("c")
    _supersede(app, a, b)
    _supersede(app, b, c)
    app.backend.store_result(c, 42, "SUCCESS")
    assert SingletonResult(a, app=app).get(timeout=10) == 42


@pytest.mark.timeout(30)
def test_get_on_two_copies_naming_each_other_waits_out_its_timeout(app: Celery) -> None:
    """a -> b -> a (a moment after the store lost the generation): a TimeoutError, no spin."""
    a, b = _id("a"), _id("b")
    _supersede(app, a, b)
    _supersede(app, b, a)
    with pytest.raises(ResultTimeout):
        SingletonResult(a, app=app).get(timeout=0.5)


@pytest.mark.timeout(30)
def test_get_on_an_unnamed_replacement_is_a_skip(app: Celery) -> None:
    """A SUPERSEDED record without ``by``: DuplicateSkipped, raised or returned as asked."""
    a = _id("a")
    _supersede(app, a, None)
    with pytest.raises(DuplicateSkipped):
        SingletonResult(a, app=app).get(timeout=5)
    returned = SingletonResult(a, app=app).get(timeout=5, propagate=False)
    assert isinstance(returned, DuplicateSkipped)


def _listening(app: Celery, task_id: str) -> bool:
    """Whether the Redis result backend still listens for ``task_id``'s result."""
    consumer = app.backend.result_consumer
    key = app.backend.get_key_for_task(task_id)
    return task_id in app.backend._pending_results.concrete or key in consumer.subscribed_to


@pytest.mark.timeout(30)
@pytest.mark.parametrize("outcome", ["SKIPPED", "SUPERSEDED"])
def test_get_stops_listening_for_a_call_that_ends_without_a_ready_state(
    app: Celery, outcome: str
) -> None:
    """SKIPPED and SUPERSEDED are not ready states: get() unsubscribes itself.

    Celery only stops listening once a result is ready; left subscribed, the
    result object reconnects to unsubscribe when it is collected, at worst
    while the interpreter shuts down.
    """
    a, b = _id("a"), _id("b")
    waiting = SingletonResult(a, app=app)
    with pytest.raises(ResultTimeout):
        waiting.get(timeout=0.3)  # subscribes while the call is pending
    assert _listening(app, a)
    if outcome == "SKIPPED":
        app.backend.store_result(a, {"holder": b, "key": "k"}, "SKIPPED")
        with pytest.raises(DuplicateSkipped):
            waiting.get(timeout=5)
    else:
        _supersede(app, a, b)
        app.backend.store_result(b, 7, "SUCCESS")
        assert waiting.get(timeout=5) == 7
    assert not _listening(app, a)
