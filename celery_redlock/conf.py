"""Settings and task options, resolved and validated in one place.

Every lock option can be set on the task (``lock_<name>``) or app-wide
(``redlock_<name>`` on ``app.conf``; Django users write ``CELERY_REDLOCK_<NAME>``).
:func:`resolve` applies task attribute > app setting > default, validates the
value and names the setting that supplied a bad one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .exceptions import ConfigurationError
from .keys import KeySpec
from .store import parse_store, redact_url

__all__ = [
    "CONFLICT_POLICIES",
    "DUPLICATE_POLICIES",
    "MODES",
    "OPTIONS",
    "PUBLISH_SIDE",
    "REDIS_ERROR_POLICIES",
    "SETTINGS",
    "LockOptions",
    "check_mode_store",
    "check_settings",
    "flag",
    "lock_url",
    "parse_queues",
    "redact_url",
    "resolve",
    "validate_settings",
]

#: What a task does when another call with the same key holds the lock.
CONFLICT_POLICIES = ("skip", "requeue", "raise")
#: What a task does when the lock's Redis cannot be reached.
REDIS_ERROR_POLICIES = ("requeue", "run", "raise")
#: When the lock is held: the lock windows (see docs/modes.md).
MODES = ("while_executing", "until_executing", "until_executed", "until_and_while_executing")
#: What ``apply_async`` does when a copy of the call is already enqueued.
DUPLICATE_POLICIES = ("return_existing", "raise")
#: Options read in ``apply_async`` by the enqueue modes: a locked queue's entry
#: cannot set them for such a task (the publisher does not know the queue).
PUBLISH_SIDE = ("key", "key_prefix", "enqueue_ttl", "on_duplicate")


@dataclass(frozen=True)
class LockOptions:
    """The resolved lock options of one task.

    Attributes:
        ttl: Lock time to live in seconds; the watchdog renews it at a third.
        key: Which arguments identify a call (see :data:`celery_redlock.keys.KeySpec`).
        on_conflict: ``"skip"``, ``"requeue"`` or ``"raise"``; unset, ``"requeue"``
            in ``until_and_while_executing`` and ``"skip"`` otherwise.
        on_redis_error: ``"requeue"`` (fail closed), ``"run"`` (fail open) or ``"raise"``.
        requeue_delay: First requeue delay in seconds; doubles with each requeue.
        requeue_max_delay: Cap of the requeue delay in seconds.
        requeue_jitter: Share of each delay drawn at random (0 to 1).
        max_requeues: Most requeues of one task before it fails; not charged
            against the task's ``max_retries``.
        key_prefix: Prefix of every lock key.
        mode: When the lock is held: one of :data:`MODES`.
        on_duplicate: ``"return_existing"`` or ``"raise"`` (enqueue modes only).
        enqueue_ttl: Seconds an enqueue lock lasts beyond the call's countdown/eta.
    """

    ttl: float = 10.0
    key: KeySpec = None
    on_conflict: str = "skip"
    on_redis_error: str = "requeue"
    requeue_delay: float = 1.0
    requeue_max_delay: float = 60.0
    requeue_jitter: float = 0.5
    max_requeues: int = 100
    key_prefix: str = "redlock"
    mode: str = "while_executing"
    on_duplicate: str = "return_existing"
    enqueue_ttl: float = 600.0


Validator = Callable[[str, Any], Any]

#: Set on a task class (``SingletonTask``) or a wrapped ``run`` that takes its own lock.
GUARDED_ATTRIBUTE = "__redlock_guarded__"


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


def _choice(choices: tuple[str, ...]) -> Validator:
    def validate(setting: str, value: Any) -> str:
        if value not in choices:
            raise ConfigurationError(setting, value, f"must be one of {', '.join(choices)}")
        return str(value)

    return validate


def _fraction(setting: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigurationError(setting, value, "must be a number from 0 to 1")
    return float(value)


def _count(setting: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(setting, value, "must be a whole number >= 0")
    return value


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


#: option name -> (validator, also an app-wide ``redlock_<name>`` setting?)
OPTIONS: Mapping[str, tuple[Validator, bool]] = {
    "ttl": (_seconds, True),
    "key": (_key_spec, False),
    "on_conflict": (_choice(CONFLICT_POLICIES), True),
    "on_redis_error": (_choice(REDIS_ERROR_POLICIES), True),
    "requeue_delay": (_seconds, True),
    "requeue_max_delay": (_seconds, True),
    "requeue_jitter": (_fraction, True),
    "max_requeues": (_count, True),
    "key_prefix": (_prefix, True),
    "mode": (_choice(MODES), True),
    "on_duplicate": (_choice(DUPLICATE_POLICIES), True),
    "enqueue_ttl": (_seconds, True),
}

#: Every app-wide setting this package reads.
SETTINGS = frozenset(
    {
        "redlock_url",
        "redlock_min_replicas",
        "redlock_replica_timeout",
        "redlock_queues",
        "redlock_transport_options",
        "redlock_recover_stale",
        "redlock_stats",
    }
    | {f"redlock_{name}" for name, (_, app_wide) in OPTIONS.items() if app_wide}
)


def resolve(
    task: Any,
    conf: Mapping[str, Any],
    queue: str | None = None,
    queue_options: Mapping[str, Any] | None = None,
) -> LockOptions:
    """Resolve and validate the lock options of ``task`` against the app's ``conf``.

    Order: task attribute ``lock_<name>`` > the entry of the locked ``queue``
    the call came from (``queue_options``) > setting ``redlock_<name>`` > default.

    Raises:
        ConfigurationError: Naming the task attribute or setting with a bad value.
    """
    defaults = LockOptions()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    unset: set[str] = set()
    queue_options = queue_options or {}
    for name, (validate, app_wide) in OPTIONS.items():
        value = getattr(task, f"lock_{name}", None)
        source = f"{task.name}.lock_{name}"
        if value is None and name in queue_options:
            value = queue_options[name]
            source = f"redlock_queues[{queue!r}].{name}"
        if value is None and app_wide:
            value = conf.get(f"redlock_{name}")
            source = f"redlock_{name}"
        values[name] = getattr(defaults, name) if value is None else validate(source, value)
        sources[name] = source
        if value is None:
            unset.add(name)
    if values["mode"] != MODES[0] and not getattr(task, GUARDED_ATTRIBUTE, False):
        # A plain task locked by its queue never passes through
        # SingletonTask.apply_async, so it cannot take an enqueue lock: an
        # app-wide mode is for SingletonTask; the task's own attribute is an error.
        if sources["mode"] == f"{task.name}.lock_mode":
            raise ConfigurationError(
                sources["mode"],
                values["mode"],
                "needs base=SingletonTask: a plain task can only lock while_executing",
            )
        values["mode"] = MODES[0]
    if "on_conflict" in unset and values["mode"] == "until_and_while_executing":
        # The one waiting copy usually reaches a free worker while the last
        # one runs; skipping it would drop the call every duplicate folded into.
        values["on_conflict"] = "requeue"
    options = LockOptions(**values)
    if options.requeue_max_delay < options.requeue_delay:
        # Name whichever of the two was given most specifically: that is the one to fix.
        at_fault = "requeue_delay" if "requeue_max_delay" in unset else "requeue_max_delay"
        other = "requeue_max_delay" if at_fault == "requeue_delay" else "requeue_delay"
        raise ConfigurationError(
            sources[at_fault],
            getattr(options, at_fault),
            f"must not exceed requeue_max_delay ({options.requeue_max_delay}, from "
            f"{sources[other]})"
            if at_fault == "requeue_delay"
            else f"is below requeue_delay ({options.requeue_delay}, from {sources[other]})",
        )
    if queue is not None and queue_options.get("mode", MODES[0]) != MODES[0]:
        # Plain tasks never pass through SingletonTask.apply_async, so a queue
        # cannot take an enqueue lock for them.
        raise ConfigurationError(
            f"redlock_queues[{queue!r}].mode",
            queue_options["mode"],
            "a queue can only lock while_executing; set lock_mode on the task",
        )
    if queue is not None and options.mode != MODES[0]:
        for name in PUBLISH_SIDE:
            if name in queue_options:
                # apply_async reserves before any queue is known: a queue entry
                # changing the key would make the worker look for another one.
                raise ConfigurationError(
                    f"redlock_queues[{queue!r}].{name}",
                    queue_options[name],
                    f"cannot apply to {task.name} (mode {options.mode}): its enqueue "
                    f"lock is taken in apply_async, which knows no queue; set lock_{name} "
                    "on the task",
                )
    return options


def parse_queues(value: Any, setting: str = "redlock_queues") -> dict[str, dict[str, Any]]:
    """Read ``redlock_queues`` (or the worker option): queue name -> lock options.

    Accepts a comma-separated string, a list of names, or a mapping of names to
    option mappings whose keys are the task option names without ``lock_``.

    Raises:
        ConfigurationError: Naming the setting, the queue and the bad part.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        value = [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, (list, tuple, set, frozenset)):
        value = dict.fromkeys(value)
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            setting, value, "must be a list of queue names or a mapping of queue name -> options"
        )
    queues: dict[str, dict[str, Any]] = {}
    for name, options in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(setting, name, "queue names must be non-empty strings")
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ConfigurationError(
                f"{setting}[{name!r}]", options, "must be a mapping of options"
            )
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigurationError(
                f"{setting}[{name!r}]",
                unknown,
                f"unknown option(s); known: {', '.join(OPTIONS)}",
            )
        queues[name] = dict(options)
    return queues


def validate_settings(conf: Mapping[str, Any]) -> None:
    """Reject misspelt ``redlock_*`` settings, which would otherwise be ignored.

    Raises:
        ConfigurationError: Naming the unknown setting and the known ones.
    """
    for name in conf:
        if isinstance(name, str) and name.lower().startswith("redlock_") and name not in SETTINGS:
            raise ConfigurationError(
                name, conf[name], f"is not a setting; known: {', '.join(sorted(SETTINGS))}"
            )


class _QueueEntry:
    """Stands in for a task when a queue's options are validated on their own.

    It counts as a ``SingletonTask``: the app-wide options it is checked with
    (``redlock_mode`` above all) are the ones such tasks take.
    """

    __redlock_guarded__ = True

    def __init__(self, queue: str) -> None:
        self.name = f"<queue {queue}>"


def check_settings(conf: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Validate every app-wide redlock setting; return the parsed ``redlock_queues``.

    Raises:
        ConfigurationError: Naming the first bad setting, queue or option.
    """
    validate_settings(conf)
    lock_url(conf)
    queues = parse_queues(conf.get("redlock_queues"))
    for name, options in queues.items():
        resolve(_QueueEntry(name), conf, name, options)
    check_mode_store("redlock_mode", resolve(_QueueEntry("*"), conf), conf)
    return queues


def flag(conf: Mapping[str, Any], setting: str, default: bool) -> bool:
    """Read an on/off setting: ``True`` or ``False``, or ``default`` when unset.

    Raises:
        ConfigurationError: If the setting holds anything but a bool.
    """
    value = conf.get(setting)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigurationError(setting, value, "must be True or False")
    return value


def check_mode_store(setting: str, options: LockOptions, conf: Mapping[str, Any]) -> None:
    """Refuse an enqueue mode on a Redlock store (a list of masters).

    Enqueue locks are handed over to execution locks by single-server scripts;
    across several independent masters that handover would need a quorum of
    its own, which is not built.

    Raises:
        ConfigurationError: Naming ``setting`` (where the mode came from).
    """
    if options.mode != "while_executing" and parse_store(conf).topology == "redlock":
        raise ConfigurationError(
            setting,
            options.mode,
            "needs a lock store on one Redis, Sentinel or Cluster; redlock_url lists "
            "several masters (Redlock), where only 'while_executing' is supported",
        )


def lock_url(conf: Mapping[str, Any]) -> str:
    """Check the lock store setting (see :mod:`celery_redlock.store`); return its description.

    The description has no password: it is meant for messages and logs.

    Raises:
        ConfigurationError: If neither ``redlock_url`` nor the broker gives a lock store.
    """
    return parse_store(conf).describe()
