"""The options of the windows that keep the newest call or limit by time, checked together.

``lock_mode="debounce"`` (with ``lock_debounce`` and ``lock_debounce_max_wait``),
``lock_keep="latest"`` (for ``until_and_while_executing``) and
``lock_mode="until_expired"`` (with ``lock_period``) each need some options and
exclude others. Each option is validated alone by :mod:`celery_redlock.calls.options`;
:func:`check_window` checks how they fit together and names the option at fault,
as the user wrote it, so every integration reports the same mistake the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from celery_redlock.core.exceptions import ConfigurationError

from .options import Keep, LockOptions, Mode

__all__ = ["check_window", "keeps_newest"]


def keeps_newest(options: LockOptions) -> bool:
    """Whether a newer call replaces an older one: debounce, or ``keep="latest"``."""
    return options.mode is Mode.DEBOUNCE or (
        options.mode is Mode.UNTIL_AND_WHILE_EXECUTING and options.keep is Keep.LATEST
    )


def check_window(options: LockOptions, source: Callable[[str], str]) -> None:
    """Refuse window options that do not fit together.

    Args:
        options: The resolved options (each already valid on its own).
        source: Maps an option name (``"debounce"``) to how the user named it
            (``"tasks.sync.lock_debounce"``, ``"debounce"``...).

    Raises:
        ConfigurationError: Naming the first option at fault.
    """
    mode = options.mode
    if options.debounce is None and mode is Mode.DEBOUNCE:
        raise ConfigurationError(
            source("debounce"),
            None,
            f"lock_mode='debounce' (from {source('mode')}) needs the quiet time in seconds",
        )
    if options.debounce is not None and mode is not Mode.DEBOUNCE:
        raise ConfigurationError(
            source("debounce"), options.debounce, f"needs lock_mode='debounce', not {mode.value!r}"
        )
    max_wait = options.debounce_max_wait
    if max_wait is not None:
        if mode is not Mode.DEBOUNCE:
            raise ConfigurationError(
                source("debounce_max_wait"), max_wait, "needs lock_mode='debounce'"
            )
        if options.debounce is not None and max_wait < options.debounce:
            raise ConfigurationError(
                source("debounce_max_wait"),
                max_wait,
                f"must be at least lock_debounce ({options.debounce})",
            )
    if options.keep is Keep.LATEST and mode is not Mode.UNTIL_AND_WHILE_EXECUTING:
        raise ConfigurationError(
            source("keep"),
            options.keep.value,
            f"'latest' needs lock_mode='until_and_while_executing', not {mode.value!r} "
            "(lock_mode='debounce' always keeps the latest)",
        )
    if options.period is None and mode is Mode.UNTIL_EXPIRED:
        raise ConfigurationError(
            source("period"),
            None,
            f"lock_mode='until_expired' (from {source('mode')}) needs the period in seconds",
        )
    if options.period is not None and mode is not Mode.UNTIL_EXPIRED:
        raise ConfigurationError(
            source("period"), options.period, f"needs lock_mode='until_expired', not {mode.value!r}"
        )
