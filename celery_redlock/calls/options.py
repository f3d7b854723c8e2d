"""Lock options, defined and validated once for every integration.

Each option is one field of :class:`LockOptions`, carrying its validator and
whether it is also an app-wide ``redlock_<name>`` setting. The policies are
enums whose members are the strings users write (``lock_mode="until_executed"``
and ``lock_mode=Mode.UNTIL_EXECUTED`` are the same), so a misspelt value fails
with the valid ones listed. Celery's settings (the order task > queue > app >
default) are resolved in :mod:`celery_redlock.celery.settings`.
"""

from __future__ import annotations

import difflib
import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.keys import KeySpec
from celery_redlock.core.permit import check_limit
from celery_redlock.core.rate import Rate, parse_rate

__all__ = [
    "CONFLICT_POLICIES",
    "DUPLICATE_POLICIES",
    "KEEP_POLICIES",
    "MODES",
    "OPTIONS",
    "REDIS_ERROR_POLICIES",
    "Keep",
    "LockOptions",
    "Mode",
    "OnConflict",
    "OnDuplicate",
    "OnRedisError",
    "Option",
    "check_choice",
    "closest_option",
    "validate",
]


class Mode(str, enum.Enum):
    """When the lock is held: the lock windows (see docs/modes.md)."""

    WHILE_EXECUTING = "while_executing"
    UNTIL_EXECUTING = "until_executing"
    UNTIL_EXECUTED = "until_executed"
    UNTIL_AND_WHILE_EXECUTING = "until_and_while_executing"
    DEBOUNCE = "debounce"
    UNTIL_EXPIRED = "until_expired"

    def __str__(self) -> str:
        return self.value


class Keep(str, enum.Enum):
    """Which call a window keeps when another comes: the first or the latest."""

    FIRST = "first"
    LATEST = "latest"

    def __str__(self) -> str:
        return self.value


class OnConflict(str, enum.Enum):
    """What a task does when another call with the same key holds the lock."""

    SKIP = "skip"
    REQUEUE = "requeue"
    RAISE = "raise"

    def __str__(self) -> str:
        return self.value


class OnRedisError(str, enum.Enum):
    """What a task does when the lock store cannot be reached."""

    REQUEUE = "requeue"
    RUN = "run"
    RAISE = "raise"

    def __str__(self) -> str:
        return self.value


class OnDuplicate(str, enum.Enum):
    """What ``apply_async`` does when a copy of the call is already enqueued."""

    RETURN_EXISTING = "return_existing"
    RAISE = "raise"

    def __str__(self) -> str:
        return self.value


#: The values of :class:`OnConflict`, in order.
CONFLICT_POLICIES = tuple(policy.value for policy in OnConflict)
#: The values of :class:`OnRedisError`, in order.
REDIS_ERROR_POLICIES = tuple(policy.value for policy in OnRedisError)
#: The values of :class:`Mode`, in order.
MODES = tuple(mode.value for mode in Mode)
#: The values of :class:`OnDuplicate`, in order.
DUPLICATE_POLICIES = tuple(policy.value for policy in OnDuplicate)
#: The values of :class:`Keep`, in order.
KEEP_POLICIES = tuple(policy.value for policy in Keep)

Validator = Callable[[str, Any], Any]


def _seconds(setting: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(setting, value, "must be a positive number of seconds")
    if value < 0.001:
        raise ConfigurationError(setting, value, "must be at least 0.001 seconds")
    return float(value)


def _optional_seconds(setting: str, value: Any) -> float | None:
    return None if value is None else _seconds(setting, value)


def _choice(kind: type[enum.Enum]) -> Validator:
    def check(setting: str, value: Any) -> Any:
        try:
            return kind(value)
        except ValueError:
            valid = ", ".join(member.value for member in kind)
            raise ConfigurationError(setting, value, f"must be one of {valid}") from None

    return check


def _fraction(setting: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigurationError(setting, value, "must be a number from 0 to 1")
    return float(value)


def _count(setting: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(setting, value, "must be a whole number >= 0")
    return value


def _flag(setting: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(setting, value, "must be True or False")
    return value


def _limit(setting: str, value: Any) -> int:
    return check_limit(setting, value)


def _key_spec(setting: str, value: Any) -> KeySpec:
    if value is None or callable(value) or isinstance(value, str):
        return value  # type: ignore[no-any-return]
    if isinstance(value, (list, tuple)) and all(isinstance(name, str) for name in value):
        return tuple(value)
    raise ConfigurationError(
        setting, value, "must be None, a list of argument names, or a callable (args, kwargs)"
    )


def _prefix(setting: str, value: Any) -> str:
    if not isinstance(value, str) or not value or "{" in value or "}" in value:
        raise ConfigurationError(setting, value, "must be a non-empty string without braces")
    return value


def _rate(setting: str, value: Any) -> Rate | None:
    if value is None:
        return None
    try:
        return parse_rate(value)
    except ValueError as exc:
        raise ConfigurationError(setting, value, str(exc)) from None


def _option(default: Any, validator: Validator, app_wide: bool = True) -> Any:
    """A :class:`LockOptions` field: default, validator, and whether ``redlock_<name>`` sets it."""
    return field(default=default, metadata={"validate": validator, "app_wide": app_wide})


@dataclass(frozen=True)
class LockOptions:
    """The resolved lock options of one task (or RQ job function).

    Attributes:
        ttl: Lock time to live in seconds; the watchdog renews it at a third.
        key: Which arguments identify a call (see :data:`celery_redlock.core.keys.KeySpec`).
        on_conflict: :class:`OnConflict`; unset, ``"requeue"`` in
            ``until_and_while_executing`` and ``"skip"`` otherwise.
        on_redis_error: :class:`OnRedisError`: ``"requeue"`` (fail closed),
            ``"run"`` (fail open) or ``"raise"``.
        requeue_delay: First requeue delay in seconds; doubles with each requeue.
        requeue_max_delay: Cap of the requeue delay in seconds.
        requeue_jitter: Share of each delay drawn at random (0 to 1).
        max_requeues: Most requeues of one task before it fails; not charged
            against the task's ``max_retries``.
        key_prefix: Prefix of every lock key.
        mode: When the lock is held: a :class:`Mode`.
        on_duplicate: :class:`OnDuplicate` (enqueue modes only).
        enqueue_ttl: Seconds an enqueue lock lasts beyond the call's countdown/eta.
        limit: Most calls with the same key running at once: 1 is a lock, more
            a semaphore of that many permits (``while_executing`` only; see
            docs/limits.md).
        rate: At most this many starts per window and rate key (``"100/m"``,
            ``"20/s"``, ``"10/5s"``), or ``None``: see docs/limits.md.
        rate_key: Which arguments make the rate key (like ``key``); ``None``:
            the same as the lock key.
        debounce: ``mode="debounce"``: seconds of quiet after a burst's last
            call before it runs, with that call's arguments.
        debounce_max_wait: ``mode="debounce"``: longest a burst waits from its
            first call, or ``None`` (no bound).
        keep: :class:`Keep`: ``"latest"`` lets a newer call replace the waiting
            copy (``until_and_while_executing`` only).
        period: ``mode="until_expired"``: seconds an accepted call refuses its
            duplicates, whether or not it has finished.
        fair: Requeued calls wait in line: the oldest is admitted first when
            the key frees (see docs/conflicts.md); ``False``: plain backoff.
    """

    ttl: float = _option(10.0, _seconds)
    key: KeySpec = _option(None, _key_spec, app_wide=False)
    on_conflict: OnConflict = _option(OnConflict.SKIP, _choice(OnConflict))
    on_redis_error: OnRedisError = _option(OnRedisError.REQUEUE, _choice(OnRedisError))
    requeue_delay: float = _option(1.0, _seconds)
    requeue_max_delay: float = _option(60.0, _seconds)
    requeue_jitter: float = _option(0.5, _fraction)
    max_requeues: int = _option(100, _count)
    key_prefix: str = _option("redlock", _prefix)
    mode: Mode = _option(Mode.WHILE_EXECUTING, _choice(Mode))
    on_duplicate: OnDuplicate = _option(OnDuplicate.RETURN_EXISTING, _choice(OnDuplicate))
    enqueue_ttl: float = _option(600.0, _seconds)
    limit: int = _option(1, _limit)
    rate: Rate | None = _option(None, _rate, app_wide=False)
    rate_key: KeySpec = _option(None, _key_spec, app_wide=False)
    debounce: float | None = _option(None, _optional_seconds, app_wide=False)
    debounce_max_wait: float | None = _option(None, _optional_seconds, app_wide=False)
    keep: Keep = _option(Keep.FIRST, _choice(Keep), app_wide=False)
    period: float | None = _option(None, _optional_seconds, app_wide=False)
    fair: bool = _option(True, _flag)


@dataclass(frozen=True)
class Option:
    """One lock option: how to validate it, and whether ``redlock_<name>`` sets it app-wide."""

    name: str
    validate: Validator
    app_wide: bool


#: Every lock option by name, read off :class:`LockOptions`.
OPTIONS: Mapping[str, Option] = {
    spec.name: Option(spec.name, spec.metadata["validate"], spec.metadata["app_wide"])
    for spec in fields(LockOptions)
}


def validate(name: str, value: Any, source: str | None = None) -> Any:
    """Validate ``value`` for lock option ``name``; return it in its canonical type.

    Raises:
        ConfigurationError: Naming ``source`` (default: the option's name).
    """
    return OPTIONS[name].validate(source or name, value)


def check_choice(setting: str, value: Any, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, for an integration's own policy sets.

    Raises:
        ConfigurationError: Naming ``setting`` and listing the choices.
    """
    if value not in choices:
        raise ConfigurationError(setting, value, f"must be one of {', '.join(choices)}")
    return str(value)


def closest_option(name: str, valid: Any = None) -> str | None:
    """The valid option name closest to a misspelt ``name``, if one is close enough."""
    matches = difflib.get_close_matches(name, list(valid if valid is not None else OPTIONS), n=1)
    return matches[0] if matches else None
