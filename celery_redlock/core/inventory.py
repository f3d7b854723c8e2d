"""The lock store's inventory: find task locks with ``SCAN`` and read who holds them.

Nothing here runs on a task's path; it serves the ``celery redlock`` commands
and the stale-lock recovery at worker start. Keys are found with ``SCAN``
(never ``KEYS``, which blocks the server) on every primary of a Redis Cluster,
and each batch of found keys is read in one pipelined round trip: the value,
its PTTL and the fence counter, stamped with the server's clock. Semaphores
(``lock_limit`` above 1) are read only when asked for: their permits set, with
one :class:`PermitInfo` per live permit.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .fences import fence_key_for, is_cluster
from .holder import Holder
from .keys import KEY_VERSION
from .semaphore_scripts import semaphore_keys

__all__ = [
    "PERMITS_SUFFIX",
    "RESERVATION_SUFFIX",
    "LockInfo",
    "PermitInfo",
    "clients_of",
    "find_locks",
    "glob_escape",
    "lock_pattern",
    "parse_key",
    "read_locks",
    "scan",
    "semaphore_key",
]

#: Keys fetched per pipelined read.
READ_BATCH = 200
#: SCAN's COUNT hint: how many slots the server visits per call.
SCAN_COUNT = 1000

#: Suffix of an enqueue reservation's key (``reservation_key`` in celery/window.py).
RESERVATION_SUFFIX = ":queued"
#: Suffix of a semaphore's permits set (see :mod:`celery_redlock.core.semaphore_scripts`).
PERMITS_SUFFIX = ":permits"

_KEY = re.compile(
    rf"^(?P<prefix>.+):{KEY_VERSION}:\{{(?P<task>.+):(?P<digest>[0-9a-f]{{64}})\}}"
    rf"(?:(?P<reserved>{RESERVATION_SUFFIX})|(?P<permits>{PERMITS_SUFFIX}))?$",
    re.S,
)
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def glob_escape(text: str) -> str:
    """Escape the ``SCAN MATCH`` glob characters of ``text``."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def lock_pattern(prefix: str, task: str | None = None) -> str:
    """Return the ``SCAN MATCH`` pattern of the locks under ``prefix`` (of one task, if given)."""
    name = glob_escape(task) if task is not None else "*"
    return f"{glob_escape(prefix)}:{KEY_VERSION}:{{{name}:*"


def parse_key(
    key: str, *, reservations: bool = False, semaphores: bool = False
) -> tuple[str, str] | None:
    """Return ``(prefix, task name)`` of a task lock key, ``None`` for any other key.

    With ``reservations``, the key of an enqueue reservation (the lock key
    plus :data:`RESERVATION_SUFFIX`) is read too; with ``semaphores``, the
    permits set of a semaphore (the lock key plus :data:`PERMITS_SUFFIX`).
    """
    match = _KEY.match(key)
    if match is None:
        return None
    if (match["reserved"] and not reservations) or (match["permits"] and not semaphores):
        return None
    return match["prefix"], match["task"]


def clients_of(store: Any) -> list[Any]:
    """Return the clients to read a lock store with: one per Redlock master, else its one client.

    A Cluster client stays whole: it routes each key to its node, and
    :func:`scan` visits every primary through it.

    Raises:
        redis.exceptions.RedisError: When a Cluster cannot be reached to learn its slots.
    """
    client = store.client
    return list(client) if store.spec.topology == "redlock" else [client]


def scan(client: Any, pattern: str, count: int = SCAN_COUNT) -> Iterator[str]:
    """Yield the keys matching ``pattern``, from every primary when ``client`` is a Cluster."""
    primaries = getattr(client, "get_primaries", None)
    nodes = [client.get_redis_connection(node) for node in primaries()] if primaries else [client]
    seen: set[str] = set()
    for node in nodes:
        for raw in node.scan_iter(match=pattern, count=count):
            key = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            # SCAN may return a key twice (the table was resized meanwhile).
            if key not in seen:
                seen.add(key)
                yield key


@dataclass(frozen=True)
class PermitInfo:
    """One live permit of a semaphore, as read from its permits set.

    Attributes:
        member: The permit's member in the set (what a release removes).
        slot: Which of the semaphore's permits it is.
        fence: Its fencing token.
        token: The holder's token (the holder value, for a task).
        holder: The holder the token names (``None`` for a token of another format).
        ttl: Seconds the permit has left.
    """

    member: str
    slot: int
    fence: int
    token: str
    holder: Holder | None
    ttl: float

    @classmethod
    def parse(cls, member: str, expiry_ms: float, now: float) -> PermitInfo | None:
        """Read a member and its score; ``None`` for one this package did not write."""
        slot, _, rest = member.partition("|")
        fence, _, token = rest.partition("|")
        if not (slot.isdigit() and fence.isdigit()):
            return None
        ttl = max(0.0, expiry_ms / 1000 - now)
        return cls(member, int(slot), int(fence), token, Holder.parse(token), ttl)

    def as_dict(self) -> dict[str, Any]:
        """The permit as plain JSON-ready data."""
        return {
            "slot": self.slot,
            "fence": self.fence,
            "token": self.holder.token if self.holder is not None else self.token,
            "holder": asdict(self.holder) if self.holder is not None else None,
            "acquired_at": (
                self.holder.acquired_ms / 1000
                if self.holder is not None and self.holder.acquired_ms
                else None
            ),
            "ttl": self.ttl,
        }


@dataclass(frozen=True)
class LockInfo:
    """One task lock as read from the store.

    Attributes:
        key: The lock key.
        task: The task name from the key.
        value: The stored value, decoded.
        holder: The holder the value names (``None`` for a value of another format).
        ttl: Seconds the lock has left (``None``: no expiry).
        fence: The fence counter the key draws from, shared by every key of
            the store (of its hash slot, on Cluster): the latest fence drawn
            there, so at least the holder's fence, and equal to it until
            another acquisition draws.
        server_time: The server's clock when the lock was read, Unix seconds.
        permits: For a semaphore, its live permits by slot (``key`` is then
            the semaphore's name, ``value`` empty, ``holder`` ``None`` and
            ``ttl`` the longest a permit has left); ``None`` for a lock.
    """

    key: str
    task: str
    value: str
    holder: Holder | None
    ttl: float | None
    fence: int | None
    server_time: float
    permits: tuple[PermitInfo, ...] | None = None

    @property
    def kind(self) -> str:
        """``"reservation"`` (an enqueue reservation), ``"semaphore"`` or ``"lock"``."""
        if self.permits is not None:
            return "semaphore"
        return "reservation" if self.key.endswith("}" + RESERVATION_SUFFIX) else "lock"

    @property
    def acquired_at(self) -> float | None:
        """Unix time of the acquisition (the holder's clock), if the value records it."""
        if self.holder is None or not self.holder.acquired_ms:
            return None
        return self.holder.acquired_ms / 1000

    @property
    def renewed_at(self) -> float | None:
        """Unix time of the latest renewal, if there was one after the acquisition.

        Every renewal sets the TTL back to its full length, so the time since
        the latest one is the full TTL minus what is left.
        """
        ttl_ms = self.holder.ttl_ms if self.holder is not None else None
        acquired = self.acquired_at
        if not ttl_ms or self.ttl is None or acquired is None:
            return None
        renewed = self.server_time - (ttl_ms / 1000 - self.ttl)
        # Within the round trip and clock skew of the acquisition: not renewed.
        return renewed if renewed - acquired > ttl_ms / 1000 / 12 else None

    @property
    def renewals(self) -> int | None:
        """How many times the watchdog renewed the lock, derived from its TTL and age.

        The watchdog renews a lease every third of its TTL, so the count is the
        time from acquisition to the latest renewal over that period, rounded.
        Exact for a process holding one lock at a time (a prefork child); a
        process renewing many locks in one pass may renew some a little
        early, which this count does not see. ``None`` when the value does not
        carry the acquisition time and TTL.
        """
        ttl_ms = self.holder.ttl_ms if self.holder is not None else None
        acquired = self.acquired_at
        if not ttl_ms or acquired is None or self.ttl is None:
            return None
        renewed = self.renewed_at
        if renewed is None:
            return 0
        return max(1, round((renewed - acquired) / (ttl_ms / 1000 / 3)))

    def as_dict(self) -> dict[str, Any]:
        """The lock as plain JSON-ready data (what ``--json`` prints)."""
        holder = asdict(self.holder) if self.holder is not None else None
        if holder is not None:
            holder.pop("token")
        return {
            "key": self.key,
            "task": self.task,
            "holder": holder,
            "acquired_at": self.acquired_at,
            "ttl": self.ttl,
            "renewals": self.renewals,
            "renewed_at": self.renewed_at,
            "fence": self.fence,
            "value": self.value,
            **(
                {"kind": "semaphore", "permits": [p.as_dict() for p in self.permits]}
                if self.permits is not None
                else {}
            ),
        }


def _decode(raw: Any) -> str | None:
    if raw is None:
        return None
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _server_time(client: Any) -> float:
    try:
        reply = client.time()
        if isinstance(reply, dict):  # a Cluster client answers per node
            reply = next(iter(reply.values()))
        seconds, micros = reply
        return float(seconds) + float(micros) / 1_000_000
    except Exception:  # TIME may be disabled (renamed) on managed servers
        return time.time()


def read_locks(
    client: Any, keys: Sequence[str], *, reservations: bool = False, semaphores: bool = False
) -> list[LockInfo]:
    """Read ``keys`` in one pipelined round trip; keys gone meanwhile are left out.

    Enqueue reservations are read only with ``reservations``; their fence is
    the one of the lock they reserve. Semaphores' permits sets (the keys
    :data:`PERMITS_SUFFIX` ends) only with ``semaphores``.
    """
    if not keys:
        return []
    pipe = client.pipeline(transaction=False)
    cluster = is_cluster(client)
    for key in keys:
        if key.endswith("}" + PERMITS_SUFFIX):
            pipe.zrange(key, 0, -1, withscores=True)
            pipe.pttl(key)
            pipe.get(fence_key_for(key.removesuffix(PERMITS_SUFFIX), cluster=cluster))
        else:
            pipe.get(key)
            pipe.pttl(key)
            pipe.get(fence_key_for(key.removesuffix(RESERVATION_SUFFIX), cluster=cluster))
    replies = pipe.execute()
    now = _server_time(client)
    found: list[LockInfo] = []
    for i, key in enumerate(keys):
        raw, pttl_ms, fence = replies[3 * i : 3 * i + 3]
        parsed = parse_key(key, reservations=reservations, semaphores=semaphores)
        if parsed is None:
            continue
        fence_text = _decode(fence)
        counter = int(fence_text) if fence_text and fence_text.isdigit() else None
        if isinstance(raw, list):
            info = _semaphore_info(key, parsed[1], raw, counter, now)
            if info is not None:
                found.append(info)
            continue
        value = _decode(raw)
        if value is None:
            continue
        found.append(
            LockInfo(
                key=key,
                task=parsed[1],
                value=value,
                holder=Holder.parse(value),
                ttl=pttl_ms / 1000 if pttl_ms is not None and pttl_ms >= 0 else None,
                fence=counter,
                server_time=now,
            )
        )
    return found


def _semaphore_info(
    key: str, task: str, members: list[Any], fence: int | None, now: float
) -> LockInfo | None:
    """The semaphore whose permits set ``key`` held ``members``; ``None`` if none is live."""
    permits = []
    for member, expiry_ms in members:
        text = _decode(member) or ""
        permit = PermitInfo.parse(text, float(expiry_ms), now) if expiry_ms / 1000 > now else None
        if permit is not None:
            permits.append(permit)
    if not permits:
        return None
    return LockInfo(
        key=key.removesuffix(PERMITS_SUFFIX),
        task=task,
        value="",
        holder=None,
        ttl=max(permit.ttl for permit in permits),
        fence=fence,
        server_time=now,
        permits=tuple(sorted(permits, key=lambda permit: permit.slot)),
    )


def semaphore_key(name: str) -> str:
    """The permits set of the semaphore ``name`` (what :func:`read_locks` reads for it)."""
    return semaphore_keys(name).permits


def find_locks(
    client: Any,
    prefixes: Iterable[str],
    task: str | None = None,
    queue: str | None = None,
    *,
    semaphores: bool = False,
) -> Iterator[LockInfo]:
    """Yield the task locks under ``prefixes`` (of one task, one queue, if given).

    Fence keys and other keys sharing a prefix are skipped. A lock whose
    value does not record its queue never matches a ``queue`` filter; a
    semaphore matches when one of its permits' holders came from ``queue``.
    Semaphores are found only with ``semaphores``.
    """
    for prefix in dict.fromkeys(prefixes):
        batch: list[str] = []
        for key in scan(client, lock_pattern(prefix, task)):
            parsed = parse_key(key, semaphores=semaphores)
            if parsed is None or parsed[0] != prefix or (task is not None and parsed[1] != task):
                continue
            batch.append(key)
            if len(batch) >= READ_BATCH:
                yield from _matching(read_locks(client, batch, semaphores=semaphores), queue)
                batch = []
        yield from _matching(read_locks(client, batch, semaphores=semaphores), queue)


def _matching(locks: Iterable[LockInfo], queue: str | None) -> Iterator[LockInfo]:
    for info in locks:
        holders = [p.holder for p in info.permits] if info.permits is not None else [info.holder]
        if queue is None or any(h is not None and h.queue == queue for h in holders):
            yield info
