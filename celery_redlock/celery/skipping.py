"""How a skipped duplicate ends its run: as a quiet return where that changes nothing users see.

A duplicate that meets a held lock under ``on_conflict="skip"`` (or over its
rate) records ``SKIPPED``, naming the holder, and must then end without Celery
storing a result over that state, running its callbacks or chain, or counting
a chord part. Celery's ``Ignore`` does all of that, but Celery turns every
``Ignore`` into an ``ExceptionInfo``: it copies each frame of the traceback with
its code-position table and formats it with source lines, and a prefork child
pickles it to the parent. That is about nine tenths of what a skipped
duplicate costs the worker.

A run whose request says ``ignore_result`` and carries no callbacks, chain or
chord has the same outcome when it simply returns: the tracer stores nothing
and sends nothing on. So the guard clears those fields of the skipped run's
own request (a per-delivery copy) and returns the skip's description.
It falls back to ``Ignore`` wherever a plain return would be seen as a
success by user code: a task class overriding ``on_success`` or
``after_return``, a connected ``task_success`` receiver, or an eager call (whose
``EagerResult`` is the result).

What monitoring sees then differs from ``Ignore`` (docs/conflicts.md): the
worker logs the run as succeeded with the skip text as its return value and
sends a ``task-succeeded`` event, and ``task_postrun`` receivers get the state
``SUCCESS``. The stored state stays ``SKIPPED``.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from celery import signals
from celery.app.trace import task_has_custom
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore

from celery_redlock.core.holder import Holder

from .result import SKIPPED

__all__ = ["Skipped", "ends_quietly", "hooks_see_success", "skip"]

logger = logging.getLogger(__name__)


class Skipped(Ignore):  # type: ignore[misc]  # celery ships no type hints
    """A duplicate skipped by the guard, after it recorded ``SKIPPED``.

    Still an ``Ignore``: where it is not turned into a return (see
    :func:`ends_quietly`), Celery ends the run exactly as for any ``Ignore``.
    Its message is what the quiet return hands to the tracer, which logs it
    as the run's return value.
    """


def skip(
    task: Any, key: str, holder: Holder | None, why: str, reason: str = "duplicate"
) -> NoReturn:
    """Record ``SKIPPED`` naming ``holder`` where the task stores results, then end the run.

    Raises:
        Skipped: Always, with ``why`` as its message.
    """
    if not task.ignore_result and not isinstance(task.backend, DisabledBackend):
        meta = {
            "reason": reason,
            "key": key,
            "holder": holder.task_id if holder else None,
            "holder_hostname": holder.hostname if holder else None,
        }
        try:
            task.update_state(state=SKIPPED, meta=meta)
        except Exception:  # recording is a courtesy; the skip stands
            logger.warning("task %s[%s]: could not record SKIPPED", task.name, task.request.id)
    raise Skipped(why)


def hooks_see_success(task: Any) -> bool:
    """Whether ``task``'s class overrides a hook that a plain return would call.

    Read once per guard: the tracer decides this too, once per task, when it
    is built.
    """
    return bool(task_has_custom(task, "on_success") or task_has_custom(task, "after_return"))


def ends_quietly(request: Any, hooks_see_it: bool) -> bool:
    """Prepare ``request`` so that returning ends the run as ``Ignore`` would; say if it may.

    ``False`` when a return would reach user code as a success (see the module
    docstring); the request is then left untouched.
    """
    if hooks_see_it or request.is_eager or signals.task_success.receivers:
        return False
    # The tracer reads these after the body returns: no result stored over
    # SKIPPED, no link callbacks, no next chain step, no chord part counted.
    request.ignore_result = True
    request.callbacks = None
    request.chain = None
    request.chord = None
    return True
