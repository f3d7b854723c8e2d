"""The options every lock class takes, validated in one place.

:class:`LockSettings` stores redis-py's lock arguments and this package's
additions for :class:`~celery_redlock.core.lock.Lock` and its asyncio twin;
:func:`check_options` rejects a bad one with a
:class:`~celery_redlock.core.exceptions.ConfigurationError` naming it.
"""

from __future__ import annotations

from typing import Any, TypeVar, Union

from . import replication as replicated
from .exceptions import ConfigurationError
from .fences import fence_key_for, is_cluster
from .lease import Clock, LostCallback
from .lua import bulk

__all__ = [
    "DEFAULT_FENCE_RETENTION",
    "LockSettings",
    "Number",
    "check_options",
    "fence_key_for",
    "key_beside",
    "positive_seconds",
]

#: Seconds, as redis-py's lock takes them.
Number = Union[int, float]

#: Lifetime of a fence counter from its latest draw; see ``scripts.ACQUIRE``.
DEFAULT_FENCE_RETENTION = 3600.0

_SettingsT = TypeVar("_SettingsT", bound="LockSettings")


def key_beside(name: str, suffix: str) -> str:
    """Return the key ``<name>:<suffix>`` in the Redis Cluster hash slot of the key ``name``.

    A name with a hash tag keeps it; any other name becomes the tag of the new
    key (``{name}:suffix``), which hashes to the same slot as the name itself.
    """
    # Redis Cluster hashes only the tag when the first "{" is followed by a
    # "}" with something in between; "{}" anywhere first means the whole key.
    start = name.find("{")
    end = name.find("}", start + 1) if start != -1 else -1
    if end > start + 1:
        return f"{name}:{suffix}"
    if "}" in name:
        # "{name}" would end its tag early; no key can share this name's slot
        # through a tag, so fall back to a plain suffix (fine outside Cluster).
        return f"{name}:{suffix}"
    return f"{{{name}}}:{suffix}"


def positive_seconds(setting: str, value: object, *, allow_none: bool) -> float | None:
    """Return ``value`` as float seconds, at least a millisecond (``None`` if allowed).

    Raises:
        ConfigurationError: If it is not such a number, naming ``setting``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(setting, value, "must be a number of seconds")
    if value <= 0 or int(value * 1000) < 1:
        raise ConfigurationError(setting, value, "must be at least 0.001 seconds")
    return float(value)


def check_options(
    *,
    timeout: object,
    sleep: object,
    blocking_timeout: object,
    auto_renew: bool,
    drift_factor: float,
    fence_retention: object,
) -> float | None:
    """Validate the options every lock class takes; return the TTL in seconds, or ``None``.

    Raises:
        ConfigurationError: For the first option out of range, naming it.
    """
    ttl = positive_seconds("timeout", timeout, allow_none=True)
    if isinstance(sleep, bool) or not isinstance(sleep, (int, float)) or sleep < 0:
        raise ConfigurationError("sleep", sleep, "must be a non-negative number of seconds")
    if blocking_timeout is not None and (
        isinstance(blocking_timeout, bool)
        or not isinstance(blocking_timeout, (int, float))
        or blocking_timeout < 0
    ):
        raise ConfigurationError(
            "blocking_timeout", blocking_timeout, "must be None or a non-negative number"
        )
    if auto_renew and ttl is None:
        raise ConfigurationError(
            "timeout", timeout, "auto_renew needs a timeout: it renews at a third of it"
        )
    if not 0 <= drift_factor < 0.5:
        raise ConfigurationError("drift_factor", drift_factor, "must be in [0, 0.5)")
    positive_seconds("fence_retention", fence_retention, allow_none=False)
    return ttl


class LockSettings:
    """The options every lock class takes (sync and asyncio), validated and stored once.

    Both lock classes keep redis-py's constructor signature for drop-in use and
    hand its values to :meth:`_configure`, so a new option is added in one place.
    """

    timeout: float | None
    #: (encoding, errors) of the client, read on the first str token encoded;
    #: copies made by renamed() share it.
    _token_encoding: tuple[str, str] | None = None

    def _configure(
        self,
        redis: Any,
        name: str,
        *,
        timeout: Number | None,
        sleep: Number,
        blocking: bool,
        blocking_timeout: Number | None,
        thread_local: bool,
        raise_on_release_error: bool,
        auto_renew: bool,
        on_lost: LostCallback | None,
        fencing: bool,
        fence_key: str | None,
        fence_retention: Number,
        drift_factor: float,
        clock: Clock,
        label: str | None,
        min_replicas: int = 0,
        replica_timeout: Number | None = None,
    ) -> None:
        self.timeout = check_options(
            timeout=timeout,
            sleep=sleep,
            blocking_timeout=blocking_timeout,
            auto_renew=auto_renew,
            drift_factor=drift_factor,
            fence_retention=fence_retention,
        )
        self.redis = redis
        self.name = name
        self.sleep = sleep
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        self.thread_local = bool(thread_local)
        self.raise_on_release_error = raise_on_release_error
        self.auto_renew = auto_renew
        self.on_lost = on_lost
        self.fencing = fencing
        self.fence_key = (
            fence_key if fence_key is not None else fence_key_for(name, cluster=is_cluster(redis))
        )
        self._fence_retention_ms = int(fence_retention * 1000)
        self._ttl_ms = int(self.timeout * 1000) if self.timeout is not None else 0
        # The acquire script's ARGV after the token, as the bytes sent: an int
        # or str argument costs the packer a conversion on every acquisition.
        self._acquire_argv = (b"%d" % self._ttl_ms, b"%d" % self._fence_retention_ms, b"0")
        # The same, packed (see Lock._packed).
        self._acquire_tail = b"".join(bulk(arg) for arg in self._acquire_argv)
        self.drift_factor = drift_factor
        self._clock = clock
        self.label = label
        #: How many replicas confirm each acquisition and renewal, or ``None``.
        self.replication = replicated.replication_for(
            min_replicas, replica_timeout, self.timeout, redis
        )

    def renamed(
        self: _SettingsT,
        name: str,
        *,
        on_lost: LostCallback | None,
        label: str | None,
        fence_key: str | None = None,
    ) -> _SettingsT:
        """Return a lock on key ``name`` with these options, checked once when this one was built.

        The task path builds one lock per call with the same options: copying
        them skips the checks, which cost more than the acquisition's Python.
        ``fence_key``: the fence counter of ``name`` (:func:`fence_key_for`),
        when the caller already knows it.
        """
        lock = object.__new__(type(self))
        lock.__dict__.update(self.__dict__)
        lock.name = name
        if fence_key is None:
            fence_key = fence_key_for(name, cluster=is_cluster(self.redis))
        lock.fence_key = fence_key
        lock.on_lost = on_lost
        lock.label = label
        lock._fresh_state()
        return lock

    def _fresh_state(self) -> None:
        """Give a new lock its own acquisition state (a lock class that keeps some)."""

    def _encode_token(self, token: str | bytes) -> bytes:
        """Encode a caller's token the way the client would send it."""
        if type(token) is str:
            # What the client's Encoder does with a str, without building
            # one per call (a pooled client makes a new Encoder each time).
            encoding = self._token_encoding
            if encoding is None:
                encoder = self.redis.get_encoder()
                encoding = self._token_encoding = (encoder.encoding, encoder.encoding_errors)
            return token.encode(*encoding)
        encoded: bytes = self.redis.get_encoder().encode(token)
        return encoded
