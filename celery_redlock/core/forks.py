"""Fork hooks, registered by the code that needs one when it first needs it.

``os.register_at_fork`` cannot be undone, so no module registers a hook when
it is imported: a process that imports the package without using a part of
it gets no hook for that part.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["in_forked_children"]

_registered: set[Callable[[], object]] = set()


def in_forked_children(hook: Callable[[], object]) -> None:
    """Run ``hook`` in every child forked from now on; registering it again does nothing.

    Call it before creating the state the hook resets, so that a child forked
    at any later moment finds the hook. Two threads registering one hook at
    the same moment may both register it; it then runs twice in each child,
    so a hook must do no harm when run twice.
    """
    if hook not in _registered:
        _registered.add(hook)
        os.register_at_fork(after_in_child=hook)
