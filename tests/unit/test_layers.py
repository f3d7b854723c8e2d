"""The package's layers, checked from the source.

What each folder may import (see the folders' docstrings and
docs/architecture.md), no import loops between modules, and modules and
functions small enough to read. Every ``import`` counts, also those inside
functions; those under ``if TYPE_CHECKING:`` count for the layers (a type is
a dependency too) but not for loops (they never run). What an import really
loads at run time is checked in test_imports.py.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_redlock"

#: The folders each folder may import, besides itself. Nothing may import ``ops``.
MAY_IMPORT: Mapping[str, set[str]] = {
    "core": set(),
    "calls": {"core"},
    "asyncio": {"core"},
    "functions": {"core", "calls", "asyncio"},
    "rq": {"core", "calls", "functions"},
    "celery": {"core", "calls"},
    "ops": {"core", "calls", "asyncio", "functions", "rq", "celery"},
}
#: The frameworks each folder may import; no other folder imports any of them.
FRAMEWORKS = ("celery", "kombu", "billiard", "click", "rq")
MAY_USE: Mapping[str, set[str]] = {
    "rq": {"rq"},
    "celery": {"celery", "kombu", "billiard", "click"},
    "ops": {"celery", "kombu", "click"},
}

# Each allow-list below is empty: nothing breaks a rule today. An entry would
# need its reason, and each test fails on an entry that no longer applies.

#: Imports that break a layer rule, and why they still exist.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}
#: Import loops that still exist, and why.
LOOP_EXCEPTIONS: dict[frozenset[str], str] = {}
#: Most lines a module may have.
MAX_MODULE_LINES = 450
#: Modules over the limit, and why.
LONG_MODULES: dict[str, str] = {}
#: Most lines a function may have (decorators, signature and docstring included)
#: unless the line above it, or its ``def`` line, says ``# long because: <reason>``.
MAX_FUNCTION_LINES = 60
#: Functions over the limit without such a comment, and why.
LONG_FUNCTIONS: dict[str, str] = {}
LONG_BECAUSE = "# long because:"


@dataclass(frozen=True)
class Import:
    """One import statement's target, as written in ``module`` at ``line``."""

    module: str
    target: str
    names: tuple[str, ...]
    line: int
    typing_only: bool


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Every module of the package, but the deprecated flat paths (one-line aliases).
MODULES = {
    _module_name(path): path for path in PACKAGE.rglob("*.py") if "_deprecated" not in path.parts
}


def _folder(module: str) -> str:
    """The layer a module is in: ``core``, ``celery``...; ``""`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "celery_redlock" else ""


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, source: str | None = None) -> list[Import]:
    """Every import in ``module`` (any depth), with relative ones made absolute.

    ``from package import name`` targets ``package.name`` when that is a module.
    """
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text() if source is None else source)
    found: list[Import] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for part in child.body:
                    visit_one(part, True)
                for part in child.orelse:
                    visit_one(part, typing_only)
            else:
                visit_one(child, typing_only)

    def visit_one(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, alias.name, (), node.lineno, typing_only))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = tuple(alias.name for alias in node.names)
            submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in MODULES]
            for target in submodules or [base]:
                found.append(Import(module, target, names, node.lineno, typing_only))
        else:
            visit(node, typing_only)

    visit(tree, False)
    return found


IMPORTS = [found for module in sorted(MODULES) for found in imports_of(module)]


def _layer_violations() -> Iterator[tuple[Import, str]]:
    for found in IMPORTS:
        here = _folder(found.module)
        if not here:
            continue  # the package's lazy top-level names
        root = found.target.split(".")[0]
        if root == "celery_redlock":
            there = _folder(found.target)
            if there and there != here and there not in MAY_IMPORT[here]:
                yield found, f"{here}/ may not import {there}/"
        elif root in FRAMEWORKS and root not in MAY_USE.get(here, set()):
            yield found, f"{here}/ may not import {root}"


def test_each_folder_imports_only_what_its_layer_may():
    """core imports only itself, calls only core, no integration reaches celery/ or ops/."""
    found = {(i.module, i.target): (i, why) for i, why in _layer_violations()}
    unexpected = [
        f"{i.module}:{i.line} imports {i.target}: {why}"
        for key, (i, why) in sorted(found.items())
        if key not in LAYER_EXCEPTIONS
    ]
    assert unexpected == []
    assert [key for key in LAYER_EXCEPTIONS if key not in found] == [], "stale exception"


def test_the_layer_check_sees_framework_imports():
    """The walk finds Celery where it is, and function-level imports too."""
    assert any(i.module == "celery_redlock.celery.task" and i.target == "celery" for i in IMPORTS)
    nested = imports_of("celery_redlock.celery.spawned")
    assert any(i.target == "celery.app.trace" for i in nested)  # imported inside a function
    source = "def f():\n    import celery\n"
    (bad,) = imports_of("celery_redlock.core.lock", source)
    assert bad.target == "celery"


def find_loops(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One loop (``a -> b -> ... -> a``) through each group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_loop_in(graph, group) for group in groups]


def _loop_in(graph: Mapping[str, set[str]], group: set[str]) -> list[str]:
    """The shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = [[start]]
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph.get(path[-1], set()) & group):
            if nxt == start:
                return [*path, start]
            if nxt not in path:
                paths.append([*path, nxt])
    raise AssertionError(f"no loop in {group}")


def test_find_loops_reports_the_path():
    """The loop finder names the modules of a loop in order, and passes a graph without one."""
    assert find_loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_loops({"a": {"b"}, "b": set()}) == []


def test_no_import_loops():
    """No module imports, at any depth and also from inside a function, one that imports it."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for found in IMPORTS:
        # The package's own __init__ is lazy: importing a name from it loads one module.
        if found.typing_only or found.target in (found.module, "celery_redlock"):
            continue
        if found.target in MODULES:
            graph[found.module].add(found.target)
    loops = find_loops(graph)
    unexpected = [" -> ".join(loop) for loop in loops if frozenset(loop) not in LOOP_EXCEPTIONS]
    assert unexpected == []
    stale = [sorted(key) for key in LOOP_EXCEPTIONS if key not in {frozenset(lp) for lp in loops}]
    assert stale == [], "stale exception"


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def test_no_module_is_over_450_lines():
    """Each module has one job that fits in 450 lines."""
    sizes = {_relative(path): len(path.read_text().splitlines()) for path in MODULES.values()}
    long = {name: size for name, size in sizes.items() if size > MAX_MODULE_LINES}
    assert {name: size for name, size in long.items() if name not in LONG_MODULES} == {}
    assert [name for name in LONG_MODULES if name not in long] == [], "stale exception"


def _functions(module: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Each function and method of ``module``, with its qualified name."""
    tree = ast.parse(MODULES[module].read_text())

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                yield from walk(child, name)
            else:
                yield from walk(child, prefix)

    for name, node in walk(tree, module):
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        yield name, node


def _long_functions() -> dict[str, int]:
    long = {}
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for name, node in _functions(module):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - first + 1
            said = [lines[first - 2] if first > 1 else "", lines[node.lineno - 1]]
            explained = any(
                LONG_BECAUSE in line and line.split(LONG_BECAUSE, 1)[1].strip() for line in said
            )
            if length > MAX_FUNCTION_LINES and not explained:
                long[name] = length
    return long


def test_no_function_is_over_60_lines_without_a_reason():
    """A function over 60 lines says why on the line above its ``def``."""
    long = _long_functions()
    assert {name: size for name, size in long.items() if name not in LONG_FUNCTIONS} == {}
    assert [name for name in LONG_FUNCTIONS if name not in long] == [], "stale exception"


def test_integrations_import_no_private_name():
    """The decorator, RQ and asyncio modules use only public names of other modules."""
    offenders = []
    for found in IMPORTS:
        if not found.module.startswith(
            ("celery_redlock.functions.decorator", "celery_redlock.rq", "celery_redlock.asyncio")
        ):
            continue
        private = [n for n in found.names if n.startswith("_") and not n.startswith("__")]
        if private and found.target.startswith("celery_redlock") and found.target != found.module:
            offenders.append((found.module, found.target, private))
    assert not offenders


def test_no_module_sets_the_context_variable_directly():
    """The context variable is set only through context.holding(), which resets it."""
    importers = [
        found.module
        for found in IMPORTS
        if found.target == "celery_redlock.calls.context" and "_current" in found.names
    ]
    assert importers == []


def test_current_lock_is_one_function_under_every_name():
    """celery_redlock.current_lock, guard.current_lock and context.current_lock are the same."""
    import celery_redlock
    from celery_redlock.calls import context
    from celery_redlock.celery import guard

    assert celery_redlock.current_lock is guard.current_lock is context.current_lock


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_each_folder_says_what_it_may_import(folder):
    """Every folder's __init__ has a docstring, which says what the folder is and may import."""
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
    assert doc and "may import" in " ".join(doc.split())
