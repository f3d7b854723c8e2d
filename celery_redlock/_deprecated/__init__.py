"""The module paths of the flat layout, kept importable with a :class:`DeprecationWarning`.

Before 0.1 every module sat directly in ``celery_redlock/``. This folder is on
the package's ``__path__``, so ``import celery_redlock.lock`` still works: each
file here is a one-line stub that warns and hands back the module at its new
home. The stubs go away in 1.0.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make the module ``old`` the module ``new``, warning the importer that it moved."""
    warnings.warn(
        f"{old} moved to {new}: import it from there (the old path goes away in 1.0)",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
