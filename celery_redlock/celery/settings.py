"""Celery settings: a task's lock options resolved from its attributes, its queue and the app.

:func:`resolve` applies task attribute ``lock_<name>`` > locked queue entry >
setting ``redlock_<name>`` (Django users write ``CELERY_REDLOCK_<NAME>``) >
default, validates each value (see :mod:`celery_redlock.calls.options`) and
names the setting that supplied a bad one. The app-wide settings
(``redlock_url``, ``redlock_queues``...) are checked here too.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from celery_redlock.calls.decisions import rate_keys
from celery_redlock.calls.options import OPTIONS, LockOptions, Mode, OnConflict, closest_option
from celery_redlock.calls.windows import check_window, keeps_newest
from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.store import parse_store, redact_url

__all__ = [
    "GUARDED_ATTRIBUTE",
    "PUBLISH_SIDE",
    "SETTINGS",
    "check_limit_store",
    "check_mode_store",
    "check_rate",
    "check_settings",
    "flag",
    "lock_url",
    "parse_queues",
    "redact_url",
    "resolve",
    "task_option",
    "unknown_task_options",
    "validate_settings",
]

#: Options read in ``apply_async`` by the enqueue modes: a locked queue's entry
#: cannot set them for such a task (the publisher does not know the queue).
PUBLISH_SIDE = (
    "key",
    "key_prefix",
    "enqueue_ttl",
    "on_duplicate",
    "debounce",
    "debounce_max_wait",
    "keep",
    "period",
)

#: Set on a task class (``SingletonTask``) or a wrapped ``run`` that takes its own lock.
GUARDED_ATTRIBUTE = "__redlock_guarded__"

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
        "redlock_reaper",
        "redlock_reaper_interval",
        "redlock_reaper_unresponsive_after",
        "redlock_metrics_port",
        "redlock_metrics_host",
        "redlock_web_token",
        "redlock_web_basic_auth",
    }
    | {f"redlock_{name}" for name, option in OPTIONS.items() if option.app_wide}
)


def task_option(task: Any, attribute: str) -> Any:
    """Read option ``attribute`` of a task as the user gave it (``None`` when unset).

    ``@app.task(lock_key=lambda args, kwargs: ...)`` makes the function a class
    attribute, so plain ``getattr`` on the task would hand back a bound method
    taking the task as a third argument. The raw attribute is read instead (a
    ``staticmethod`` or ``classmethod`` given on purpose is honoured).
    """
    try:
        value = inspect.getattr_static(task, attribute)
    except AttributeError:
        return None
    if isinstance(value, (staticmethod, classmethod)):
        return getattr(task, attribute)
    return value


def unknown_task_options(task: Any) -> list[tuple[str, str | None]]:
    """The ``lock_*`` attributes of ``task`` that name no option, each with the closest valid name.

    ``lock_key_for`` is a method of the task class, not an option.
    """
    known = {f"lock_{name}" for name in OPTIONS} | {"lock_key_for"}
    found = set()
    for klass in task.__mro__ if isinstance(task, type) else type(task).__mro__:
        for attribute in vars(klass):
            if attribute.startswith("lock_") and attribute not in known:
                # Compared without the shared "lock_", which would make every
                # name look close to some option.
                closest = closest_option(attribute[len("lock_") :], OPTIONS)
                found.add((attribute, f"lock_{closest}" if closest else None))
    return sorted(found)


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
    for name, option in OPTIONS.items():
        value = task_option(task, f"lock_{name}")
        source = f"{task.name}.lock_{name}"
        if value is None and name in queue_options:
            value = queue_options[name]
            source = f"redlock_queues[{queue!r}].{name}"
        if value is None and option.app_wide:
            value = conf.get(f"redlock_{name}")
            source = f"redlock_{name}"
        values[name] = getattr(defaults, name) if value is None else option.validate(source, value)
        sources[name] = source
        if value is None:
            unset.add(name)
    _check_mode(task, values, sources)
    if "on_conflict" in unset and values["mode"] in (Mode.UNTIL_AND_WHILE_EXECUTING, Mode.DEBOUNCE):
        # The one waiting copy usually reaches a free worker while the last
        # one runs; skipping it would drop the call every duplicate folded into.
        values["on_conflict"] = OnConflict.REQUEUE
    options = LockOptions(**values)
    if keeps_newest(options):
        options = _newest_call_waits(options, sources, unset)
    check_window(options, sources.__getitem__)
    _check_requeue_delays(options, sources, unset)
    if queue is not None:
        _check_queue_entry(task.name, options, queue, queue_options)
    return options


def _check_mode(task: Any, values: dict[str, Any], sources: dict[str, str]) -> None:
    """Settle the lock window a task can have, and refuse a limit it cannot take."""
    if values["mode"] is not Mode.WHILE_EXECUTING and not getattr(task, GUARDED_ATTRIBUTE, False):
        # A plain task locked by its queue never passes through
        # SingletonTask.apply_async, so it cannot take an enqueue lock: an
        # app-wide mode is for SingletonTask; the task's own attribute is an error.
        if sources["mode"] == f"{task.name}.lock_mode":
            raise ConfigurationError(
                sources["mode"],
                values["mode"],
                "needs base=SingletonTask: a plain task can only lock while_executing",
            )
        values["mode"] = Mode.WHILE_EXECUTING
    if values["limit"] > 1 and values["mode"] is not Mode.WHILE_EXECUTING:
        # An enqueue window keeps one copy of a call queued and hands its
        # reservation over to one execution lock: N holders have no meaning there.
        raise ConfigurationError(
            sources["limit"],
            values["limit"],
            f"works only with lock_mode='while_executing'; {task.name} has "
            f"{values['mode']} (from {sources['mode']})",
        )


def _newest_call_waits(
    options: LockOptions, sources: dict[str, str], unset: set[str]
) -> LockOptions:
    """Requeue the newest copy of a debounced or keep-latest call that meets a running one.

    That copy carries every call it replaced: skipping or failing it would drop
    them all and break the window's promise that the newest call runs. An
    app-wide ``redlock_on_conflict`` or a locked queue's ``on_conflict`` (meant
    for the other windows and tasks) is therefore not inherited, and a task
    attribute asking for anything but ``"requeue"`` is refused.
    """
    source = sources["on_conflict"]
    if "on_conflict" in unset or not source.endswith(".lock_on_conflict"):
        return dataclasses.replace(options, on_conflict=OnConflict.REQUEUE)
    if options.on_conflict is not OnConflict.REQUEUE:
        raise ConfigurationError(
            source,
            options.on_conflict.value,
            f"must be 'requeue' with lock_mode={options.mode.value!r}"
            f"{' and lock_keep=latest' if options.mode is Mode.UNTIL_AND_WHILE_EXECUTING else ''}: "
            "the newest call meeting a running one waits; skipping or failing it would drop "
            "every call it replaced",
        )
    return options


def _check_requeue_delays(options: LockOptions, sources: dict[str, str], unset: set[str]) -> None:
    """Refuse a first requeue delay above the cap, naming the more specific of the two settings."""
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


def _check_queue_entry(
    task_name: str, options: LockOptions, queue: str, queue_options: Mapping[str, Any]
) -> None:
    """Refuse a locked queue's entry that cannot apply to this task's lock window."""
    if queue_options.get("mode", Mode.WHILE_EXECUTING) != Mode.WHILE_EXECUTING:
        # Plain tasks never pass through SingletonTask.apply_async, so a queue
        # cannot take an enqueue lock for them.
        raise ConfigurationError(
            f"redlock_queues[{queue!r}].mode",
            queue_options["mode"],
            "a queue can only lock while_executing; set lock_mode on the task",
        )
    if options.mode is Mode.WHILE_EXECUTING:
        return
    for name in PUBLISH_SIDE:
        if name in queue_options:
            # apply_async reserves before any queue is known: a queue entry
            # changing the key would make the worker look for another one.
            raise ConfigurationError(
                f"redlock_queues[{queue!r}].{name}",
                queue_options[name],
                f"cannot apply to {task_name} (mode {options.mode}): its enqueue "
                f"lock is taken in apply_async, which knows no queue; set lock_{name} "
                "on the task",
            )


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
        names = [name.strip() for name in value.split(",") if name.strip()]
        if not names:  # an empty shell variable, say: locking nothing is not what was meant
            raise ConfigurationError(setting, value, "names no queue; to lock none, leave it unset")
        value = names
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

    Under a namespace (``config_from_object(..., namespace="CELERY")``, as
    Django projects load Celery settings) Celery reads a setting as the
    namespace plus its name in the namespace's case (``CELERY_REDLOCK_TTL``),
    so such names are checked too.

    Raises:
        ConfigurationError: Naming the unknown setting and the closest known
            one, or every known one when none is close.
    """
    namespace = getattr(conf, "prefix", None) or ""
    for name in conf:
        if not isinstance(name, str):
            continue
        head, rest = "", name
        if namespace and name.startswith(namespace):
            head, rest = namespace, name[len(namespace) :]
        if not rest.lower().startswith("redlock_"):
            continue
        # The spelling Celery finds: lower case, or the namespace's case after it.
        case = str.upper if head and head.isupper() else str.lower
        if rest == case(rest) and rest.lower() in SETTINGS:
            continue
        # Compared without the shared "redlock_", which would make every name
        # look close to some setting.
        short = len("redlock_")
        closest = closest_option(rest.lower()[short:], [known[short:] for known in SETTINGS])
        if closest:
            hint = f"did you mean {head}{case('redlock_' + closest)}?"
        else:
            hint = f"known: {', '.join(sorted(SETTINGS))}"
        raise ConfigurationError(name, conf[name], f"is not a setting; {hint}")


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
    app_wide = resolve(_QueueEntry("*"), conf)
    check_mode_store("redlock_mode", app_wide, conf)
    check_limit_store("redlock_limit", app_wide, conf)
    for name, options in queues.items():
        limit_from = f"redlock_queues[{name!r}].limit" if "limit" in options else "redlock_limit"
        check_limit_store(limit_from, resolve(_QueueEntry(name), conf, name, options), conf)
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


def check_limit_store(setting: str, options: LockOptions, conf: Mapping[str, Any]) -> None:
    """Refuse a limit above 1 on a Redlock store (a list of masters).

    The semaphore is one sorted set on one server; a quorum version over
    independent masters is not built.

    Raises:
        ConfigurationError: Naming ``setting`` (where the limit came from).
    """
    if options.limit > 1 and parse_store(conf).topology == "redlock":
        raise ConfigurationError(
            setting,
            options.limit,
            "needs a lock store on one Redis, Sentinel or Cluster; redlock_url lists "
            "several masters (Redlock), where a semaphore has no quorum version",
        )


def lock_url(conf: Mapping[str, Any]) -> str:
    """Check the lock store setting (see :mod:`celery_redlock.core.store`); return its description.

    The description has no password: it is meant for messages and logs.

    Raises:
        ConfigurationError: If neither ``redlock_url`` nor the broker gives a lock store.
    """
    return parse_store(conf).describe()


def check_rate(task: Any, options: LockOptions, conf: Mapping[str, Any]) -> None:
    """Refuse a rate limit this task cannot have; build its rate keys once to check them.

    Raises:
        ConfigurationError: Naming ``lock_rate`` (an enqueue mode, or a store of
            several Redlock masters, where one sliding window cannot be kept
            exactly) or ``lock_rate_key`` (an argument the task does not take).
    """
    if options.rate is None:
        return
    setting = f"{task.name}.lock_rate"
    if options.mode is not Mode.WHILE_EXECUTING:
        raise ConfigurationError(
            setting, str(options.rate), f"needs lock_mode 'while_executing', not {options.mode!r}"
        )
    if parse_store(conf).topology == "redlock":
        raise ConfigurationError(
            setting,
            str(options.rate),
            "needs a lock store on one Redis, Sentinel or Cluster; redlock_url lists "
            "several masters (Redlock)",
        )
    rate_keys(task.name, task.run, options)
