"""The execution lock of the windows that keep the newest call: it runs only the newest copy.

A call in ``debounce`` or ``keep="latest"`` draws the next generation of its
key when it is published (``STAMP`` in :mod:`celery_redlock.core.newest_scripts`)
and carries it (a Celery header, an RQ job's meta). :class:`NewestLock` takes
the execution lock only for the copy that still carries the newest
generation, in one ``CLAIM``; an older copy learns which copy replaced it.
Integrations decide what a superseded copy records.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from .lock import Lease, Lock
from .newest_scripts import CLAIM, STAMP, UNSTAMP

__all__ = [
    "NewestLock",
    "Stamp",
    "generation_key",
    "parse_stamp",
    "script_ms",
    "stamp",
    "unstamp",
]


def generation_key(key: str) -> str:
    """The hash holding the newest generation of lock key ``key`` (same hash slot)."""
    return f"{key}:newest"


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Stamp:
    """The generation one published call carries.

    Attributes:
        epoch: The generation hash's epoch (a random token drawn when it was made).
        generation: The call's generation: higher is newer.
        delay: Seconds until the call may run (a debounce's quiet time, else 0).
        replaced: The call id that was the newest before this one ("" for none).
    """

    epoch: str
    generation: int
    delay: float
    replaced: str

    def encode(self) -> str:
        """``"<epoch>:<generation>"``: what the message carries (see :func:`parse_stamp`)."""
        return f"{self.epoch}:{self.generation}"


def script_ms(seconds: float | None) -> int:
    """Seconds as a script's milliseconds: ``0`` for none, and never below 1 ms otherwise."""
    return 0 if seconds is None else max(1, int(seconds * 1000))


def stamp(
    client: Any,
    key: str,
    call_id: str,
    *,
    debounce: float | None,
    max_wait: float | None,
    keep_for: float,
) -> Stamp:
    """Draw the next generation of lock key ``key`` for call ``call_id`` (one ``STAMP``).

    Args:
        client: The lock store's client.
        key: The call's lock key.
        call_id: The new call's id (task or job id).
        debounce: Quiet seconds of a debounce, or ``None``.
        max_wait: Longest a debounce burst waits from its first call, or ``None``.
        keep_for: Seconds the generation lasts beyond the call's delay.

    Raises:
        redis.exceptions.RedisError: If the store cannot be reached.
    """
    gen, epoch, delay_ms, replaced = STAMP(
        client,
        (generation_key(key),),
        (
            call_id,
            script_ms(debounce),
            script_ms(max_wait),
            script_ms(keep_for),
            secrets.token_hex(8),
        ),
    )
    return Stamp(_text(epoch), int(gen), delay_ms / 1000, _text(replaced))


def unstamp(client: Any, key: str, call_id: str, drawn: Stamp) -> bool:
    """Give back the generation drawn for a call that was never published.

    Returns:
        ``True`` if given back; ``False`` when a newer call came meanwhile.

    Raises:
        redis.exceptions.RedisError: If the store cannot be reached.
    """
    reply = UNSTAMP(client, (generation_key(key),), (drawn.generation, call_id, drawn.replaced))
    return bool(reply)


def parse_stamp(value: Any) -> tuple[str, str] | None:
    """``(epoch, generation)`` from a message's generation header, or ``None``."""
    if not isinstance(value, str) or ":" not in value:
        return None
    epoch, _, gen = value.rpartition(":")
    return (epoch, gen) if gen.isdigit() else None


class NewestLock(Lock):
    """The execution lock of a copy that runs only if it still carries the newest generation.

    After a refused :meth:`acquire`, :attr:`superseded_by` names the copy that
    replaced this one, or :attr:`recovered` says that the generation was lost
    and this copy now stands as the newest; otherwise a copy runs
    (:attr:`refusal`).

    Args:
        redis: The lock store's client.
        name: The lock key.
        stamp: ``(epoch, generation)`` the message carries, or ``None``.
        task_id: The message's task id.
        keep_ms: How long the generation hash lasts after this call.
        **kwargs: :class:`~celery_redlock.core.lock.Lock`'s options.
    """

    def __init__(
        self,
        redis: Any,
        name: str,
        *,
        stamp: tuple[str, str] | None,
        task_id: str,
        keep_ms: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(redis, name, **kwargs)
        self.stamp = stamp
        self.task_id = task_id
        self.keep_ms = keep_ms
        #: The task id of the copy that replaced this one, after a refusal.
        self.superseded_by: str | None = None
        #: The generation hash was gone; this copy registered itself as the newest.
        self.recovered = False

    def do_acquire(self, token: bytes) -> bool:
        """Make one ``CLAIM``; on success store the new lease for this thread."""
        sent_at = self._clock()
        epoch, gen = self.stamp or ("", "")
        self.superseded_by, self.recovered = None, False  # of this attempt only
        reply = CLAIM(
            self.redis,
            (self.name, self.fence_key, generation_key(self.name)),
            (token, self._ttl_ms, self._fence_retention_ms, gen, epoch, self.task_id, self.keep_ms),
        )
        status = int(reply[0])
        self.local.holder = None
        if status == 1:
            self.local.lease = self._new_lease(Lease, self.redis, token, int(reply[1]), sent_at)
            return True
        if status == 0:
            self.local.holder = (_text(reply[2]), reply[1] / 1000 if reply[1] >= 0 else None)
        elif status == 2:
            self.superseded_by = _text(reply[1])
        else:
            self.recovered = True
        return False
