"""What importing the package does: load its modules, never Celery outside the Celery layer.

Each check runs in a fresh interpreter, so what an import loaded or changed is
exactly what that interpreter holds afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import celery_redlock

# Each check starts fresh interpreters (about seventy in all): bounded, but
# not by the default 60 s on a machine whose cores are busy.
pytestmark = pytest.mark.timeout(600)

PACKAGE = Path(celery_redlock.__file__).parent
FRAMEWORKS = ("celery", "kombu")

#: Top-level names that are the Celery integration; every other one is not.
CELERY_NAMES = ("SKIPPED", "SUPERSEDED", "SingletonTask", "install")

#: Modules whose import does something on purpose, and why.
IMPORTED_FOR_EFFECT = {
    # A spawned prefork pool process is given nothing but the app's `imports`
    # setting: importing this module is its only way in (see its docstring).
    "celery_redlock.celery.spawn_hook": "connects the per-queue set-up of a spawned pool process",
}

#: Makes ``import celery`` and ``import kombu`` fail, as if they were not installed.
WITHOUT_CELERY = textwrap.dedent(
    """
    import sys

    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("celery", "kombu"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    """
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(*folders: str) -> list[str]:
    """The modules of the package's folders (all of them without arguments), sorted."""
    roots = [PACKAGE / folder for folder in folders] or [PACKAGE]
    names = {_module_name(path) for root in roots for path in root.rglob("*.py")}
    return sorted(name for name in names if "._deprecated" not in name)


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter; return what it printed."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _last_json(code: str) -> Any:
    return json.loads(_python(code).splitlines()[-1])


def _frameworks_after(statement: str) -> list[str]:
    """The Celery and kombu modules that ``statement`` loads in a fresh interpreter."""
    report = (
        "import json, sys\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})))"
    )
    return list(_last_json(f"{statement}\n{report}"))


FRAMEWORK_FREE = [
    "import celery_redlock",
    *(
        f"from celery_redlock import {name}"
        for name in celery_redlock.__all__
        if name not in CELERY_NAMES
    ),
    *(f"import {name}" for name in _modules("core", "calls", "functions", "asyncio", "rq")),
]


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    """What each framework-free import loads, a few interpreters at a time."""
    with ThreadPoolExecutor(4) as pool:
        return dict(zip(FRAMEWORK_FREE, pool.map(_frameworks_after, FRAMEWORK_FREE)))


@pytest.mark.parametrize("statement", FRAMEWORK_FREE)
def test_framework_free_imports_load_no_celery(statement, loaded):
    """The lock core, the guarded call, the decorator, asyncio and RQ never load Celery or kombu."""
    assert loaded[statement] == []


@pytest.mark.parametrize("name", CELERY_NAMES)
def test_the_celery_names_do_load_celery(name):
    """The check above can fail: the Celery integration's names load Celery."""
    assert "celery" in _frameworks_after(f"from celery_redlock import {name}")


def test_without_celery_the_core_works_and_the_celery_layer_names_the_extra():
    """Without Celery installed the core imports; the Celery layer raises one clear ImportError."""
    framework_free = "\n".join(FRAMEWORK_FREE)
    celery_layer = [
        *(f"from celery_redlock import {name}" for name in CELERY_NAMES),
        "import celery_redlock.celery.task",
        "import celery_redlock.ops.cli",
    ]
    code = (
        WITHOUT_CELERY
        + framework_free
        + textwrap.dedent(
            f"""
        import json
        errors = []
        for statement in {celery_layer!r}:
            try:
                exec(statement)
            except ImportError as exc:
                errors.append(str(exc))
            else:
                errors.append(None)
        print(json.dumps(errors))
        """
        )
    )
    errors = _last_json(code)
    assert len(errors) == len(celery_layer)
    for message in errors:
        assert message is not None and "pip install 'celery-redlock[celery]'" in message


#: Records, in a fresh interpreter, what the package changes outside itself: fork
#: hooks and Celery signal receivers of its own, Celery's worker command and
#: control panel, threads, import hooks and logging handlers. Celery itself is
#: imported before the first look.
SIDE_EFFECTS = textwrap.dedent(
    """
    import importlib, json, logging, os, sys, threading, weakref

    import celery.signals
    from celery.bin.worker import worker as worker_command
    from celery.utils.dispatch import Signal
    from celery.worker.control import Panel

    fork_hooks = []
    register_at_fork = os.register_at_fork

    def ours(function):
        module = str(getattr(function, "__module__", None))
        return module if module.startswith("celery_redlock") else None

    def recording(**hooks):
        fork_hooks.extend(filter(None, map(ours, hooks.values())))
        register_at_fork(**hooks)

    os.register_at_fork = recording

    def receivers():
        found = []
        for name, signal in sorted(vars(celery.signals).items()):
            if not isinstance(signal, Signal):
                continue
            for _, receiver in signal.receivers:
                if isinstance(receiver, weakref.ReferenceType):
                    receiver = receiver()
                if ours(receiver):
                    found.append(f"{name}:{ours(receiver)}")
        return sorted(found)

    def look():
        return {
            "fork hooks": sorted(fork_hooks),
            "signal receivers": receivers(),
            "worker options": sorted(str(p.name) for p in worker_command.params),
            "control commands": sorted(Panel.data),
            "threads": sorted(t.name for t in threading.enumerate()),
            "import hooks": [len(sys.meta_path), len(sys.path_hooks)],
            "root log handlers": len(logging.getLogger().handlers),
        }

    before = look()
    for name in MODULES:
        importlib.import_module(name)
    after = look()
    print(json.dumps({k: [before[k], after[k]] for k in before if before[k] != after[k]}))
    """
)


def _changes_made_by(modules: list[str]) -> dict[str, Any]:
    return dict(_last_json(f"MODULES = {modules!r}\n{SIDE_EFFECTS}"))


def test_importing_every_module_changes_nothing_outside_the_package():
    """No import registers a fork hook, connects a signal, edits Celery or starts a thread."""
    modules = [name for name in _modules() if name not in IMPORTED_FOR_EFFECT]
    assert "celery_redlock.ops.cli" in modules and "celery_redlock.core.nodes" in modules
    assert _changes_made_by(modules) == {}


@pytest.mark.parametrize("name", sorted(IMPORTED_FOR_EFFECT))
def test_the_modules_imported_for_effect_still_have_one(name):
    """Each module on the allow-list does change something when imported (else drop it)."""
    assert _changes_made_by([name]) != {}


def test_loading_the_cli_group_plugs_into_celery_once():
    """The entry point's ``redlock`` adds the worker options, inspect command and hook, once."""
    changes = _changes_made_by(["celery_redlock.ops.cli"])
    assert changes == {}
    code = SIDE_EFFECTS.replace(
        "importlib.import_module(name)",
        "importlib.import_module(name).redlock\n    importlib.import_module(name).redlock",
    )
    changes = _last_json(f"MODULES = ['celery_redlock.ops.cli']\n{code}")
    before, after = changes["worker options"]
    assert sorted({*after} - {*before}) == [
        "redlock_metrics_port",
        "redlock_queues",
        "redlock_recover_stale",
    ]
    assert len(after) == len(before) + 3
    before, after = changes["control commands"]
    assert sorted({*after} - {*before}) == ["redlock_stats"]
    before, after = changes["signal receivers"]
    assert len(after) == len(before) + 1
    assert "worker_init:celery_redlock.ops.cli" in after


def _deprecated_paths() -> dict[str, str]:
    """Each old flat module path, and the module it now names (read from its stub)."""
    import ast

    paths = {}
    for stub in sorted((PACKAGE / "_deprecated").glob("*.py")):
        if stub.name == "__init__.py":
            continue
        call = next(
            (
                node
                for node in ast.walk(ast.parse(stub.read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "alias"
            ),
            None,
        )
        if call is None:
            continue  # a module split in two: see SPLIT_MODULES
        old, new = (arg.value for arg in call.args)  # type: ignore[attr-defined]
        assert old == f"celery_redlock.{stub.stem}"
        paths[old] = new
    return paths


def test_the_flat_paths_warn_and_give_the_module_at_its_new_home():
    """``import celery_redlock.lock`` (and every other old path) warns, then is the new module."""
    paths = _deprecated_paths()
    assert paths["celery_redlock.lock"] == "celery_redlock.core.lock"
    assert paths["celery_redlock.signals"] == "celery_redlock.celery.signals"
    code = textwrap.dedent(
        f"""
        import importlib, json, warnings
        results = {{}}
        for old, new in {paths!r}.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = importlib.import_module(old)
            results[old] = [
                sorted({{w.category.__name__ for w in caught}}),
                any(new in str(w.message) for w in caught),
                module is importlib.import_module(new),
            ]
        print(json.dumps(results))
        """
    )
    results = _last_json(code)
    assert results == {old: [["DeprecationWarning"], True, True] for old in paths}


#: Old flat modules now split in two, and a name each new home provides.
SPLIT_MODULES = {
    "celery_redlock.conf": {
        "resolve": "celery_redlock.celery.settings",
        "LockOptions": "celery_redlock.calls.options",
    },
    "celery_redlock.enqueue": {
        "apply_async": "celery_redlock.celery.publish",
        "EnqueueGuard": "celery_redlock.celery.window",
        "RESERVATION_HEADER": "celery_redlock.celery.messages",
    },
}


def test_the_split_flat_modules_warn_and_keep_their_names():
    """``celery_redlock.conf`` and ``.enqueue`` warn, and their names are the new modules' own."""
    code = textwrap.dedent(
        f"""
        import importlib, json, warnings
        results = {{}}
        for old, names in {SPLIT_MODULES!r}.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = importlib.import_module(old)
            results[old] = [
                sorted({{w.category.__name__ for w in caught}}),
                all(
                    getattr(module, name) is getattr(importlib.import_module(home), name)
                    for name, home in names.items()
                ),
            ]
        print(json.dumps(results))
        """
    )
    assert _last_json(code) == {old: [["DeprecationWarning"], True] for old in SPLIT_MODULES}
