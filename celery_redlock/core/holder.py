"""The value stored in a task's lock: a random token plus who holds it, and since when.

Carrying the holder in the value costs nothing extra (it is written by the
acquire that happens anyway) and lets a refused duplicate, and an operator
listing the locks, see which task, worker and process hold a lock, since
when and for how long a TTL. The random part keeps every value unique, so
compare-and-delete never matches a lock taken by another acquisition.

Two formats exist; :meth:`Holder.parse` reads both, :meth:`Holder.encode`
writes the newer one::

    v1|token|task_id|node|pid
    v2|token|task_id|node|pid|acquired_ms|ttl_ms|host|queue

A :class:`~celery_redlock.core.redlock.Redlock` that retries stores ``|N`` after
the value on its ``N``-th attempt; :meth:`Holder.parse` reads past it.

``node`` is the worker's node name (``celery@host`` or whatever ``-n`` gave),
``host`` the machine's host name, ``acquired_ms`` the holder's wall clock at
acquisition in Unix milliseconds, ``ttl_ms`` the lock's TTL (0: none) and
``queue`` the queue the task came from (empty when unknown).

Within a field ``%`` is written ``%25`` and ``|`` is written ``%7C``, so a task
id, node or queue holding either reads back unchanged, and a value whose
fields hold neither is exactly the plain join. Versions before this escape
wrote ``_`` for ``|``; their values still parse, with the ``_`` kept.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

__all__ = ["Holder", "Refusal", "queue_of"]

_FORMAT = "v2"
_OLD_FORMAT = "v1"
_SEPARATOR = "|"
_HOST = socket.gethostname()
_ESCAPED = re.compile("%25|%7C")


def _escape(field: str) -> str:
    # "%" first, so the "%" that escapes the separator is not escaped again.
    return field.replace("%", "%25").replace(_SEPARATOR, "%7C")


def _unescape(field: str) -> str:
    # One pass, reading only the two sequences _escape writes: "%257C" is a
    # literal "%7C", and any other "%" (say "%20", in a value written before
    # the escape existed) stays as written. Only an old value that spelt "%25"
    # or "%7C" literally reads differently than it was meant.
    return _ESCAPED.sub(lambda match: "%" if match.group() == "%25" else _SEPARATOR, field)


def queue_of(delivery_info: Mapping[str, Any] | None) -> str | None:
    """Return the queue a delivery came from, when its route names it.

    With Celery's default direct routing a message is published to the
    anonymous exchange with the queue's name as routing key; other routes do
    not tell the queue, and ``None`` is returned.
    """
    if not delivery_info or delivery_info.get("exchange") not in ("", None):
        return None
    key = delivery_info.get("routing_key")
    return key if isinstance(key, str) and key else None


# (hostname, ttl, queue, pid) -> the escaped fields around the acquisition time.
_STATIC_FIELDS: dict[tuple[str, float | None, str | None, int], tuple[str, str]] = {}
# A worker has a few node names and queues; a bound keeps odd callers from growing it.
_STATIC_FIELDS_MAX = 256


def _static_fields(
    hostname: str, ttl: float | None, queue: str | None, pid: int
) -> tuple[str, str]:
    """The escaped ``node|pid`` and ``ttl_ms|host|queue`` of a value, built once per set."""
    key = (hostname, ttl, queue, pid)
    fields = _STATIC_FIELDS.get(key)
    if fields is None:
        if len(_STATIC_FIELDS) >= _STATIC_FIELDS_MAX:
            _STATIC_FIELDS.clear()
        ttl_ms = int(ttl * 1000) if ttl else 0
        fields = _STATIC_FIELDS[key] = (
            f"{_escape(hostname)}|{pid}",
            f"{ttl_ms}|{_escape(_HOST)}|{_escape(queue or '')}",
        )
    return fields


@dataclass(frozen=True)
class Holder:
    """Who holds a lock.

    Attributes:
        task_id: The id of the holding task.
        hostname: The worker node name (or host name) of the holder.
        pid: The holding process.
        token: The random part of the value.
        acquired_ms: Wall-clock time of the acquisition, Unix milliseconds
            (``None`` in values of the ``v1`` format).
        ttl_ms: The lock's TTL in milliseconds, 0 for none (``None`` in ``v1``).
        host: The machine the holder runs on (``None`` in ``v1``).
        queue: The queue the holding task came from, if known.
    """

    task_id: str
    hostname: str
    pid: int
    token: str
    acquired_ms: int | None = None
    ttl_ms: int | None = None
    host: str | None = None
    queue: str | None = None

    @classmethod
    def new(
        cls,
        task_id: str,
        hostname: str | None = None,
        *,
        ttl: float | None = None,
        queue: str | None = None,
    ) -> Holder:
        """Describe the current process taking a lock for ``task_id`` now.

        Args:
            task_id: The holding task's id.
            hostname: The worker node name; the host name when not given.
            ttl: The lock's TTL in seconds (``None``: no expiry).
            queue: The queue the task came from, if known.
        """
        return cls(
            task_id=task_id,
            hostname=hostname or _HOST,
            pid=os.getpid(),
            token=secrets.token_hex(16),
            acquired_ms=int(time.time() * 1000),
            ttl_ms=int(ttl * 1000) if ttl else 0,
            host=_HOST,
            queue=queue,
        )

    def encode(self) -> str:
        """Return the value to store under the lock key (format ``v2``)."""
        fields = (
            _FORMAT,
            self.token,
            self.task_id,
            self.hostname,
            str(self.pid),
            str(self.acquired_ms or 0),
            str(self.ttl_ms or 0),
            self.host or "",
            self.queue or "",
        )
        return _SEPARATOR.join(_escape(field) for field in fields)

    @staticmethod
    def new_value(
        task_id: str,
        hostname: str | None = None,
        *,
        ttl: float | None = None,
        queue: str | None = None,
    ) -> str:
        """Return ``Holder.new(...).encode()``, without building the holder.

        Every task's lock carries one, so the fields that stay the same from
        call to call in a process (node, pid, TTL, host, queue) are escaped
        and joined once and kept.
        """
        static = _static_fields(hostname or _HOST, ttl, queue, os.getpid())
        if "%" in task_id or _SEPARATOR in task_id:
            task_id = _escape(task_id)
        return (
            # secrets.token_hex(16), without its three Python frames: the
            # same 16 bytes of os.urandom, in hex.
            f"{_FORMAT}|{os.urandom(16).hex()}|{task_id}|{static[0]}"
            f"|{int(time.time() * 1000)}|{static[1]}"
        )

    @staticmethod
    def owner_field(value: str | bytes) -> str:
        """Return the task id field of a value this package wrote, as stored (escaped).

        ``""`` for a value of another format. A semaphore compares it with the
        same field of its permits' values, so that a task never holds two
        permits at once (see :mod:`celery_redlock.core.semaphore_scripts`).
        """
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        fields = value.split(_SEPARATOR, 3)
        if len(fields) == 4 and fields[0] in (_FORMAT, _OLD_FORMAT):
            return fields[2]
        return ""

    @staticmethod
    def fragment(task_id: str, hostname: str) -> str:
        """Return the part of every value written for ``task_id`` on worker ``hostname``."""
        return f"{_SEPARATOR}{_escape(task_id)}{_SEPARATOR}{_escape(hostname)}{_SEPARATOR}"

    @classmethod
    def parse(cls, value: str | bytes | None) -> Holder | None:
        """Read a stored value (``v1`` or ``v2``); ``None`` for values neither format wrote."""
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if not value:
            return None
        fields = [_unescape(field) for field in value.split(_SEPARATOR)]
        if len(fields) == 10 and fields[0] == _FORMAT and fields[9].isdigit():
            # A later attempt of a Redlock acquisition stores "value|N"
            # (redlock.ATTEMPT_SEPARATOR): the holder is the same.
            del fields[9]
        if len(fields) == 5 and fields[0] == _OLD_FORMAT and fields[4].isdigit():
            _, token, task_id, hostname, pid = fields
            return cls(task_id=task_id, hostname=hostname, pid=int(pid), token=token)
        if (
            len(fields) != 9
            or fields[0] != _FORMAT
            or not all(field.isdigit() for field in fields[4:7])
        ):
            return None
        _, token, task_id, hostname, pid, acquired_ms, ttl_ms, host, queue = fields
        return cls(
            task_id=task_id,
            hostname=hostname,
            pid=int(pid),
            token=token,
            acquired_ms=int(acquired_ms),
            ttl_ms=int(ttl_ms),
            host=host or None,
            queue=queue or None,
        )


@dataclass(frozen=True)
class Refusal:
    """Who held a key when an acquire was refused, as the store reported it.

    For a semaphore the holder reported is the permit that frees first (or the
    one held by the refused caller's own task, which refuses it whatever the
    count), and ``held``, ``limit`` and ``waiting`` say how full it was.

    Attributes:
        value: The holder's lock value, or ``None`` when the store did not say
            (``SET NX`` without fencing, a Redlock without a majority view).
        ttl: Seconds the holder's lock had left, or ``None`` (unknown, or no expiry).
        held: Permits held (semaphores only).
        limit: Permits the semaphore has (semaphores only).
        waiting: Callers on the key's wait list (semaphores, and acquires in line).
        rank: The refused caller's place in line (0: next), when it waits in
            line (see :mod:`~celery_redlock.core.queue_scripts`), else ``None``.
        arrival_us: When the caller first joined the line (server clock, microseconds).
        now_ms: The server clock at the refusal, in milliseconds.
    """

    value: str | None = None
    ttl: float | None = None
    held: int | None = None
    limit: int | None = None
    waiting: int | None = None
    rank: int | None = None
    arrival_us: int | None = None
    now_ms: int | None = None

    @classmethod
    def of(cls, reported: tuple[str | None, float | None] | None) -> Refusal:
        """Build a refusal from a lock's ``(value, ttl)`` report (``None``: nothing known)."""
        return cls(*reported) if reported is not None else cls()

    @cached_property
    def holder(self) -> Holder | None:
        """The parsed holder, or ``None`` when the value is unknown or not this package's.

        Parsed once: a refusal is read several times while it is decided, logged,
        counted and recorded (a skipped duplicate read it six times).
        """
        return Holder.parse(self.value)

    @property
    def holder_id(self) -> str | None:
        """The holding task's (or call's) id; the raw value for a foreign one."""
        holder = self.holder
        return holder.task_id if holder is not None else self.value

    def describe(self, kind: str = "task") -> str:
        """Say who holds the key, e.g. ``task 1f3c (on celery@a, pid 12)``, for log lines.

        For a semaphore: ``task 1f3c (on celery@a, pid 12), one of 3/3 permit holders,``.
        """
        holder = self.holder
        if holder is not None:
            who = f"{kind} {holder.task_id} (on {holder.hostname}, pid {holder.pid})"
        else:
            who = self.value or "another holder"
        if self.limit is None:
            return who
        queue = f" and {self.waiting} waiting" if self.waiting else ""
        if self.value is None:
            return f"{self.held}/{self.limit} permit holders{queue}"
        return f"{who}, one of {self.held}/{self.limit} permit holders{queue},"
