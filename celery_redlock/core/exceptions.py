"""The error hierarchy of celery-redlock.

Every error the package raises derives from :class:`RedlockError`. Lock errors
also derive from redis-py's own lock errors, so code written against
``redis.lock.Lock`` that catches ``redis.exceptions.LockError`` or
``LockNotOwnedError`` keeps working with :class:`celery_redlock.Lock`.
"""

from __future__ import annotations

from collections.abc import Mapping

from redis import exceptions as redis_exceptions

__all__ = [
    "ConfigurationError",
    "DuplicateSkipped",
    "DuplicateTask",
    "LockError",
    "LockKeyError",
    "LockNotAcquired",
    "LockNotOwned",
    "QuorumNotAchieved",
    "RateLimited",
    "RedlockError",
    "ReplicationError",
]


class RedlockError(Exception):
    """Base class of every error raised by celery-redlock."""

    def __repr__(self) -> str:
        # redis-py 8 gives its errors a repr of only "server:ClassName", which
        # is what Celery's "raised unexpected" log line prints: say what happened.
        return f"{type(self).__name__}({str(self)!r})"


class ConfigurationError(RedlockError, ValueError):
    """A setting or option has an invalid value.

    Attributes:
        setting: The name of the setting or option, as the user spells it.
        value: The rejected value.
    """

    def __init__(self, setting: str, value: object, reason: str) -> None:
        self.setting = setting
        self.value = value
        self.reason = reason
        super().__init__(f"{setting}={value!r}: {reason}")


class LockKeyError(RedlockError, ValueError):
    """A task's arguments cannot be turned into a lock key.

    Attributes:
        task_name: The task whose key failed.
        argument: The argument at fault, when one is.
    """

    def __init__(self, task_name: str, argument: str | None, reason: str) -> None:
        self.task_name = task_name
        self.argument = argument
        where = f"argument {argument!r} of task {task_name}" if argument else f"task {task_name}"
        super().__init__(f"cannot build the lock key of {where}: {reason}")


class LockError(RedlockError, redis_exceptions.LockError):
    """A lock operation failed.

    Attributes:
        lock_name: The Redis key of the lock, when known.
    """

    def __init__(self, message: str, lock_name: str | None = None) -> None:
        # redis-py's LockError stores ``lock_name`` itself; keep the same shape.
        super().__init__(message, lock_name=lock_name)
        self.lock_name = lock_name


class LockNotAcquired(LockError):
    """The lock is held by someone else (contention).

    Attributes:
        holder: The value stored by the current holder, when it was read.
        holder_ttl: Seconds the holder's lock has left, when known.
    """

    def __init__(
        self,
        message: str,
        lock_name: str | None = None,
        *,
        holder: str | None = None,
        holder_ttl: float | None = None,
    ) -> None:
        super().__init__(message, lock_name=lock_name)
        self.holder = holder
        self.holder_ttl = holder_ttl


class RateLimited(LockNotAcquired):
    """A call was not started: its rate key had no free slot (or was backed off).

    Attributes:
        retry_after: Seconds until a slot frees.
    """

    def __init__(self, message: str, lock_name: str | None = None, *, retry_after: float) -> None:
        super().__init__(message, lock_name=lock_name)
        self.retry_after = retry_after


class DuplicateTask(LockNotAcquired):
    """``apply_async`` found a copy of the same call already enqueued (or running).

    Raised under ``lock_on_duplicate="raise"``, and for a call carrying canvas
    links (a chain, callbacks, a group or chord) whatever that option says:
    folding such a call into the existing copy would drop what follows it.

    Attributes:
        task_id: The id of the copy holding the reservation, when it is known.
        holder_ttl: Seconds its reservation has left, when known.
    """

    def __init__(
        self,
        message: str,
        lock_name: str | None = None,
        *,
        task_id: str | None = None,
        holder_ttl: float | None = None,
    ) -> None:
        super().__init__(message, lock_name=lock_name, holder=task_id, holder_ttl=holder_ttl)
        self.task_id = task_id


class DuplicateSkipped(LockNotAcquired):
    """``AsyncResult.get()`` of a task call that was skipped as a duplicate.

    The call never ran: another call with the same key held the lock
    (``lock_on_conflict="skip"``). Its state stays ``SKIPPED`` in the result
    backend; ``get()`` raises this at once instead of waiting for a result
    that will never come.

    Attributes:
        task_id: The id of the skipped call.
        holder: The id of the call that held the lock, when it was recorded.
    """

    def __init__(
        self,
        message: str,
        lock_name: str | None = None,
        *,
        task_id: str | None = None,
        holder: str | None = None,
    ) -> None:
        super().__init__(message, lock_name=lock_name, holder=holder)
        self.task_id = task_id


class LockNotOwned(LockError, redis_exceptions.LockNotOwnedError):
    """The lock was lost or taken over: its key no longer holds our token."""


def _forget_frames(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and of the errors it was raised from.

    A lock keeps its last failure for the caller to read, and a traceback
    keeps every frame it passed through, the lock's own among them: a
    reference cycle, which holds the lock's connections open until the
    cyclic collector runs (and that finalizes a socket and its connection in
    no set order). What each master answered stays in the error itself.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


class QuorumNotAchieved(LockError):
    """A majority of Redlock masters did not agree, or agreed too late to be of use.

    Raised where :class:`Lock` raises :class:`LockNotAcquired` (a ``with``
    block that could not take the lock), and by release, extend and reacquire
    when the masters that answered were too few to tell.

    Attributes:
        errors: For each master that did not agree, by node name, why: a
            :class:`LockNotAcquired` (someone else holds it there), a
            :class:`LockNotOwned` (our token is not there), or the redis-py
            error, a ``TimeoutError`` for a master that did not answer in time.
            Kept without their tracebacks, whose frames would keep the lock alive.
        granted: How many masters agreed.
        needed: The quorum: more than half of the masters.
        holder: The value held on most of the masters that refused, when any did.
        holder_ttl: The longest time that holder has left on them, in seconds.
    """

    def __init__(
        self,
        message: str,
        lock_name: str | None = None,
        *,
        errors: Mapping[str, BaseException] | None = None,
        granted: int = 0,
        needed: int = 0,
        holder: str | None = None,
        holder_ttl: float | None = None,
    ) -> None:
        super().__init__(message, lock_name=lock_name)
        self.errors: dict[str, BaseException] = dict(errors or {})
        for error in self.errors.values():
            _forget_frames(error)
        self.granted = granted
        self.needed = needed
        self.holder = holder
        self.holder_ttl = holder_ttl

    def __repr__(self) -> str:
        # redis-py 8's errors repr as "server:ClassName"; log lines need the details.
        return f"{type(self).__name__}({str(self)!r})"


class ReplicationError(RedlockError, redis_exceptions.RedisError):
    """A lock write was not confirmed by enough replicas, or the server refused it as a master.

    Raised by acquisitions and renewals of a lock with ``min_replicas``: the
    write is then given back (acquire) or not counted (renewal). It is a
    ``RedisError``, so a task meets it as a lock store failure and follows its
    ``lock_on_redis_error`` policy, never as a held lock.

    Attributes:
        lock_name: The Redis key of the lock.
        server: The server that took (or refused) the write, as logs name it.
        event: What the server's answer says about the topology: ``"replicas"``
            (too few replicas acknowledged: they left, lag, or a failover
            promoted one), ``"demoted"`` (the server reports itself a replica,
            ``READONLY``) or ``"isolated"`` (``NOREPLICAS``: the server's own
            ``min-replicas-to-write`` is not met).
        acknowledged: How many replicas acknowledged the write (0 when refused).
        needed: How many had to.
    """

    def __init__(
        self,
        message: str,
        *,
        lock_name: str | None = None,
        server: str = "",
        event: str = "replicas",
        acknowledged: int = 0,
        needed: int = 0,
    ) -> None:
        super().__init__(message)
        self.lock_name = lock_name
        self.server = server
        self.event = event
        self.acknowledged = acknowledged
        self.needed = needed

    def __repr__(self) -> str:
        # redis-py 8's errors repr as "server:ClassName"; log lines need the details.
        return f"{type(self).__name__}({str(self)!r})"
