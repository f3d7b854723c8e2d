"""The package's errors read well where Celery and loggers print them (repr), not only str."""

from __future__ import annotations

import pytest

from celery_redlock import (
    ConfigurationError,
    DuplicateSkipped,
    DuplicateTask,
    LockError,
    LockNotAcquired,
    LockNotOwned,
)


@pytest.mark.parametrize(
    "error",
    [
        LockError("release failed", lock_name="k"),
        LockNotAcquired("task t[1] not run: task 2 holds k", lock_name="k", holder="2"),
        LockNotOwned("not owned", lock_name="k"),
        DuplicateTask("task t not published", lock_name="k", task_id="2"),
        DuplicateSkipped("task 1 was skipped", lock_name="k", task_id="1", holder="2"),
        ConfigurationError("redlock_ttl", -1, "must be a positive number of seconds"),
    ],
)
def test_repr_names_the_class_and_the_message(error):
    # redis-py 8's own repr would read "server:LockNotAcquired", the whole of
    # what Celery's "raised unexpected" line showed.
    assert repr(error) == f"{type(error).__name__}({str(error)!r})"
    assert str(error) in repr(error)


def test_skipped_duplicates_are_lock_not_acquired_errors():
    error = DuplicateSkipped("skipped", lock_name="k", task_id="1", holder="2")
    assert isinstance(error, LockNotAcquired)
    assert (error.task_id, error.holder, error.lock_name) == ("1", "2", "k")
