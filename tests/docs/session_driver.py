"""Runs one documentation page's Python examples, in order, in one interpreter.

Started by :class:`tests.docs.examples.PageSession` as ``python session_driver.py``
in the page's working directory. It reads one JSON request per line on stdin
and answers each with one JSON line on the stdout it was started with:

- ``{"op": "exec", "file": "docs/lock.md", "line": 40, "code": "..."}`` runs the
  block in the page's namespace (shared by the page's blocks, like a doctest
  session). Tracebacks name the page and its line numbers. What it prints is
  sent back, for pages that show it.
- ``{"op": "import", "module": "proj"}`` imports a file block the runner has
  saved in the working directory, as ``celery -A proj`` would.

After each request, every Celery app in the namespace (or the imported module)
is finalized, which binds its tasks: a ``SingletonTask`` validates its lock
options then, as at worker start. The answer is ``{"ok": true}`` or
``{"ok": false, "error": "<traceback>"}``, with ``"stdout"``. What the examples print, and the
output of processes they start, goes to stderr (the runner's log), never to
the answers (beyond the ``stdout`` of an ``exec``, copied there too).

Standard library only: a new virtualenv with just the project installed can run it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import linecache
import os
import sys
import traceback
from typing import Any


def _finalize_apps(namespace: dict[str, Any]) -> None:
    celery = sys.modules.get("celery")
    app_class = getattr(celery, "Celery", None)
    if app_class is None:
        return
    for value in list(namespace.values()):
        if isinstance(value, app_class):
            value.finalize(auto=True)


def _exec(namespace: dict[str, Any], request: dict[str, Any], printed: io.StringIO) -> None:
    filename, first_line, code = request["file"], int(request["line"]), request["code"]
    # Padding puts the block at its own line numbers, so tracebacks point into the page.
    source = "\n" * (first_line - 1) + code
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    with contextlib.redirect_stdout(printed):
        exec(compile(source, filename, "exec"), namespace)
    _finalize_apps(namespace)


def _import(request: dict[str, Any]) -> None:
    module = importlib.import_module(request["module"])
    _finalize_apps(vars(module))


def main() -> int:
    """Serve requests until stdin closes; return the exit status."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the examples' prints go where the runner logs them
    sys.path.insert(0, os.getcwd())
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    for raw in sys.stdin:
        request = json.loads(raw)
        printed = io.StringIO()
        try:
            if request["op"] == "exec":
                _exec(namespace, request, printed)
            elif request["op"] == "import":
                _import(request)
            else:
                raise ValueError(f"unknown request {request['op']!r}")
        except BaseException:  # SystemExit too: an example must not end the session
            answer = {"ok": False, "error": traceback.format_exc()}
        else:
            answer = {"ok": True}
        answer["stdout"] = printed.getvalue()
        sys.stdout.write(answer["stdout"])
        sys.stdout.flush()
        sys.stderr.flush()
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
