"""The import layers of the package: what may import Celery, and who may share a private name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_redlock"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every ``import``/``from`` of ``path`` as (absolute module, imported names)."""
    name = _module_name(path)
    # The package that relative imports start from.
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, [alias.name for alias in node.names]))
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _closure(name: str) -> set[str]:
    """Modules ``name`` imports, directly or through other modules of the package."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        for module, _ in _imports(MODULES[current]):
            if module in seen:
                continue
            seen.add(module)
            if module in MODULES and module != "celery_redlock":
                todo.append(module)
    return seen


@pytest.mark.parametrize(
    "name",
    [
        "celery_redlock.calls.context",
        "celery_redlock.functions.decorator",
        "celery_redlock.core.lock",
        "celery_redlock.core.redlock",
        "celery_redlock.core.semaphore",
        "celery_redlock.core.admission",
        "celery_redlock.functions.coroutine",
        "celery_redlock.asyncio.redlock",
        "celery_redlock.asyncio.semaphore",
    ],
)
def test_framework_free_modules_never_reach_celery(name):
    """The lock core, the decorator and the asyncio lock import neither Celery nor the guard."""
    reached = _closure(name)
    assert not {m for m in reached if m == "celery" or m.startswith("celery.")}
    assert "celery_redlock.celery.guard" not in reached


def test_the_walk_finds_celery_where_it_is():
    """The task module reaches Celery and the guard, so the check above can fail."""
    reached = _closure("celery_redlock.celery.task")
    assert "celery_redlock.celery.guard" in reached
    assert any(m.startswith("celery.") for m in reached)


def test_integrations_import_no_private_name():
    """The decorator, RQ and asyncio modules use only public names of other modules."""
    offenders = []
    for name, path in MODULES.items():
        if not name.startswith(
            ("celery_redlock.functions.decorator", "celery_redlock.rq", "celery_redlock.asyncio")
        ):
            continue
        for module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and module.startswith("celery_redlock") and module != name:
                offenders.append((name, module, private))
    assert not offenders


def test_no_module_sets_the_context_variable_directly():
    """The context variable is set only through context.holding(), which resets it."""
    importers = [
        name
        for name, path in MODULES.items()
        for module, names in _imports(path)
        if module == "celery_redlock.calls.context" and "_current" in names
    ]
    assert importers == []


def test_current_lock_is_one_function_under_every_name():
    """celery_redlock.current_lock, guard.current_lock and context.current_lock are the same."""
    import celery_redlock
    from celery_redlock.calls import context
    from celery_redlock.celery import guard

    assert celery_redlock.current_lock is guard.current_lock is context.current_lock
