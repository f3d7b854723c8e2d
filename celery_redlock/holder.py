"""The value stored in a task's lock: a random token plus who holds it.

Carrying the holder in the value costs nothing extra (it is written by the
acquire that happens anyway) and lets a refused duplicate report which task,
worker and process hold the lock. The random part keeps every value unique,
so compare-and-delete never matches a lock taken by another acquisition.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass

__all__ = ["Holder"]

_FORMAT = "v1"
_SEPARATOR = "|"


def _clean(field: str) -> str:
    return field.replace(_SEPARATOR, "_")


@dataclass(frozen=True)
class Holder:
    """Who holds a lock.

    Attributes:
        task_id: The id of the holding task.
        hostname: The worker node name (or host name) of the holder.
        pid: The holding process.
        token: The random part of the value.
    """

    task_id: str
    hostname: str
    pid: int
    token: str

    @classmethod
    def new(cls, task_id: str, hostname: str | None = None) -> Holder:
        """Describe the current process taking a lock for ``task_id``."""
        return cls(
            task_id=task_id,
            hostname=hostname or socket.gethostname(),
            pid=os.getpid(),
            token=secrets.token_hex(16),
        )

    def encode(self) -> str:
        """Return the value to store under the lock key."""
        fields = (_FORMAT, self.token, self.task_id, self.hostname, str(self.pid))
        return _SEPARATOR.join(_clean(field) for field in fields)

    @staticmethod
    def fragment(task_id: str, hostname: str) -> str:
        """Return the part of every value written for ``task_id`` on worker ``hostname``."""
        return f"{_SEPARATOR}{_clean(task_id)}{_SEPARATOR}{_clean(hostname)}{_SEPARATOR}"

    @classmethod
    def parse(cls, value: str | bytes | None) -> Holder | None:
        """Read a stored value; ``None`` for values this format did not write."""
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if not value:
            return None
        fields = value.split(_SEPARATOR)
        if len(fields) != 5 or fields[0] != _FORMAT or not fields[4].isdigit():
            return None
        _, token, task_id, hostname, pid = fields
        return cls(task_id=task_id, hostname=hostname, pid=int(pid), token=token)
