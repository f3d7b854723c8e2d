"""Holders as operators see them: whether one is alive, what a checked release did, times.

Shared by the ``celery redlock`` commands (:mod:`celery_redlock.ops.commands`,
:mod:`celery_redlock.ops.permits`) and the dashboard.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery_redlock.core.error_text import describe_error
from celery_redlock.core.holder import Holder
from celery_redlock.core.recovery import pid_alive

__all__ = ["Liveness", "ReleaseOutcome", "holder_liveness", "ttl_text", "when"]


def when(seconds: float | None) -> str:
    """A Unix time as ``YYYY-MM-DD HH:MM:SS.mmm`` (UTC); ``-`` for ``None``."""
    if seconds is None:
        return "-"
    moment = datetime.fromtimestamp(seconds, timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def ttl_text(seconds: float | None) -> str:
    """Seconds left as ``12.3s``; ``none`` for no expiry."""
    return "none" if seconds is None else f"{seconds:.1f}s"


@dataclass(frozen=True)
class Liveness:
    """Whether a lock's holder is alive, and how that was found out.

    Attributes:
        alive: ``True`` (alive), ``False`` (gone) or ``None`` (cannot tell).
        reason: One sentence saying what was checked.
    """

    alive: bool | None
    reason: str


def holder_liveness(app: Any, holder: Holder | None, timeout: float) -> Liveness:
    """Find out whether ``holder``'s worker is alive.

    The holder's worker node is pinged by remote control (that node only).
    A node that does not answer may still have a process running the task
    (an orphaned pool process, a worker busy past the timeout): on the same
    host the holder's pid is checked as well.
    """
    if holder is None:
        return Liveness(None, "the value does not name a celery-redlock holder")
    node = holder.hostname
    try:
        replies = app.control.ping(destination=[node], timeout=timeout)
    except Exception as exc:
        return Liveness(None, f"could not ping worker {node}: {describe_error(exc)}")
    if any(node in reply for reply in replies or ()):
        return Liveness(True, f"worker {node} answers ping")
    silent = f"worker {node} did not answer a ping within {timeout:g}s"
    if holder.host is not None and holder.host == socket.gethostname():
        if pid_alive(holder.pid):
            return Liveness(True, f"{silent}, but pid {holder.pid} still runs on this host")
        return Liveness(False, f"{silent} and pid {holder.pid} is not running on this host")
    where = f"host {holder.host}" if holder.host else "an unrecorded host"
    return Liveness(False, f"{silent} (pid {holder.pid} on {where} cannot be checked from here)")


@dataclass(frozen=True)
class ReleaseOutcome:
    """What a checked release did, in the words the CLI and the dashboard show.

    Attributes:
        released: Whether the lock was deleted.
        refused: Whether it was left because its holder is or may be alive.
        message: One sentence: what happened and what was checked.
    """

    released: bool
    refused: bool
    message: str
