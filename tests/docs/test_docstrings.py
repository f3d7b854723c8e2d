"""Every public name of the package has a docstring.

Public means: each name in ``celery_redlock.__all__``; each name in the
``__all__`` of every public module (``celery_redlock.<folder>.<name>``, no
leading underscore); and the public methods and properties those classes define
themselves. Module constants are documented by a comment right above the
assignment: ``#:`` for those the API reference shows (``docs/_ext/docstrings.py``
reads it), or the contract block above each Lua script.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

import celery_redlock

#: Modules imported for what their import does, never by the API: walking them would do it here.
IMPORTED_FOR_EFFECT = {"celery_redlock.celery.spawn_hook"}


def public_modules() -> list[ModuleType]:
    # The package's own folder only: the deprecated flat paths on its __path__
    # are aliases of these modules.
    names = [
        info.name
        for info in pkgutil.walk_packages(celery_redlock.__path__[:1], prefix="celery_redlock.")
        if not any(part.startswith("_") for part in info.name.split("."))
        and info.name not in IMPORTED_FOR_EFFECT
    ]
    # Deeper modules first, the package last: a name a package re-exports is
    # credited to the module defining it.
    names.sort(key=lambda name: (-name.count("."), name))
    return [*(importlib.import_module(name) for name in names), celery_redlock]


def _own_doc(obj: Any) -> str | None:
    # inspect.getdoc would inherit a base class's docstring, which says nothing
    # about what this override does.
    doc = obj.__doc__ if not isinstance(obj, property) else (obj.fget and obj.fget.__doc__)
    return doc.strip() if isinstance(doc, str) and doc.strip() else None


def _constant_documented(module: ModuleType, name: str) -> bool:
    lines = inspect.getsource(module).splitlines()
    for index, line in enumerate(lines):
        if line.startswith((f"{name} =", f"{name}:")):
            # "#:" is what the API reference reads; a plain comment block (the
            # KEYS/ARGV contract above each Lua script) documents it for readers.
            return index > 0 and lines[index - 1].lstrip().startswith("#")
    return False


def public_objects() -> Iterator[tuple[str, Any, ModuleType]]:
    seen: set[tuple[str, int]] = set()
    for module in MODULES:
        yield module.__name__, module, module
        for name in getattr(module, "__all__", []):
            if name.startswith("__"):
                continue
            obj = getattr(module, name)
            if (name, id(obj)) in seen:
                continue
            seen.add((name, id(obj)))
            yield f"{module.__name__}.{name}", obj, module
            if inspect.isclass(obj) and obj.__module__.startswith("celery_redlock"):
                for attr, member in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if inspect.isfunction(member) or isinstance(member, property):
                        yield f"{module.__name__}.{name}.{attr}", member, module


MODULES = public_modules()
OBJECTS = list(public_objects())


def test_the_walk_reaches_the_public_api():
    """The walk sees modules, classes, functions and methods, so it cannot pass empty."""
    names = {name for name, _, _ in OBJECTS}
    assert "celery_redlock.celery.task.SingletonTask.lock_key_for" in names
    assert "celery_redlock.core.lock.Lock.acquire" in names
    assert "celery_redlock.calls.context.current_lock" in names
    assert "celery_redlock.core.renewal" in names


@pytest.mark.parametrize(("name", "obj", "module"), OBJECTS, ids=[n for n, _, _ in OBJECTS])
def test_public_name_has_a_docstring(name, obj, module):
    """A public module, class, function, method or property has its own docstring."""
    is_code = inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)
    if is_code or isinstance(obj, property):
        assert _own_doc(obj), f"{name} has no docstring"
    elif getattr(obj, "help", None):  # a click command: its help is its docstring
        assert obj.help.strip()
    else:  # a constant, alias or signal: a comment above its assignment
        # Documented where it is assigned, whichever module re-exports it.
        # The module that lists it counts too: a module-level value that the
        # package reassigns at run time (lanes.change) is no longer the one
        # collected here once an earlier test has changed it.
        short = name.rsplit(".", 1)[-1]
        homes = [module, *(m for m in MODULES if getattr(m, short, None) is obj)]
        assert any(_constant_documented(m, short) for m in homes), f"{name} has no comment above it"
