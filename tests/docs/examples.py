"""The documentation's examples, collected from the Markdown, and a runner for them.

Every fenced block labelled ``python`` or ``console`` in the pages of
:data:`PAGES` is an example, and the test suite runs it as it stands in the
page (tests/docs/test_examples.py), against a private ``redis-server`` and,
where the page starts one, a real ``celery worker``. The conventions a page
follows:

- **Labels.** ``python`` (or ``py``) and ``console`` blocks are examples;
  ``text``, ``ini``, ``toml``, ``json`` and ``yaml`` blocks are not. A block
  without a label, or with another one, is an error: an example cannot drop
  out of the tests through a typo.
- **Python.** A page's Python blocks run in order in one interpreter, like a
  doctest session: a later block sees the names an earlier one defined. A
  block whose first line is a comment naming a file (``# proj.py``) is a file
  the reader saves: it is written to the page's working directory and
  imported, so that ``celery -A proj`` and later blocks find it. After each
  block, every Celery app in reach is finalized, which validates its tasks'
  lock options as a worker start would. A name that no earlier block of the
  page defines, and that is not a builtin, is an error even in a function the
  page never calls: the reader would meet it. A ``text`` block right after a Python
  block, marked ``<!-- test: output -->``, is what that block prints, checked
  as console output is.
- **Console.** ``$ `` starts a command (a trailing ``\\`` continues it); the
  lines up to the next command are its output, checked when the page shows
  any: ``...`` stands for any text, ``(exit status N)`` for a non-zero exit
  status. Commands run with ``bash`` in the page's working directory, with the
  test interpreter's ``bin`` first on ``PATH``. A ``celery ... worker``
  command, or an ``rq worker`` without ``--burst``, keeps running in the
  background, like a worker in another terminal, until the page's next worker
  command or the page's end; the next block runs once it logs that it is ready
  (so Celery worker commands in the pages say ``-l INFO``; an ``rq worker``
  logs at INFO by default, and names its Redis with ``--url``, which the
  runner can point at the test's server).
- **Not run.** An example that cannot run has, on the line right before its
  fence, ``<!-- test: skip reason="..." -->``, and the page says the same
  reason in its text, where readers see it. A marker without a reason, or
  with a reason the page does not state, is an error.
- **Where Redis is.** Examples name the usual local Redis, ``localhost:6379``
  (or ``127.0.0.1:6379``, or redis-py's default, ``redis.Redis()``). The
  runner points exactly these at the test's private server, in the code it
  runs and back in the output it compares; nothing else in an example changes.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import symtable
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = [
    "PAGES",
    "REPO_ROOT",
    "Address",
    "Background",
    "Block",
    "Command",
    "DocsError",
    "ExampleFailed",
    "Marker",
    "PageSession",
    "console_commands",
    "examples",
    "output_matches",
    "parse_page",
    "run_page",
    "undefined_names",
    "visible_text",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The pages whose examples the test suite runs.
PAGES = (
    "README.md",
    "docs/quickstart.md",
    "docs/celery.md",
    "docs/conflicts.md",
    "docs/configuration.md",
    "docs/lock.md",
    "docs/index.md",
    "docs/decorator.md",
    "docs/asyncio.md",
    "docs/rq.md",
    "docs/limits.md",
    "docs/modes.md",
    "docs/queues.md",
    "docs/redlock.md",
    "docs/topologies.md",
    "docs/migrating.md",
)

PYTHON = frozenset({"python", "py", "python3"})
CONSOLE = frozenset({"console"})
NOT_EXAMPLES = frozenset({"text", "ini", "toml", "json", "yaml"})

_DRIVER = Path(__file__).with_name("session_driver.py")
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER_START = re.compile(r"<!--\s*test\b")
_MARKER = re.compile(r"^\s*<!--\s*test:\s*(?P<action>[a-z-]+)(?P<fields>.*?)-->\s*$")
_FIELD = re.compile(r'\s*(?P<key>[a-z_]+)="(?P<value>[^"]*)"')
_FILE_BLOCK = re.compile(r"^#\s*(?P<name>[A-Za-z_]\w*(?:/[A-Za-z_]\w*)*\.py)\s*$")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_EXIT_STATUS = re.compile(r"^\(exit status (?P<status>\d+)\)$")
_WORKER_READY = {
    "celery": re.compile(r"\S+@\S+ ready\."),
    "rq": re.compile(r"\*\*\* Listening on "),
}
# Seconds a worker gets to exit after SIGTERM before SIGKILL. An rq worker on
# redis-py 8.2 sits out a 60 s pubsub poll before it exits, its jobs done (see
# docs/rq.md, "RQ versions"): nothing is left to wait for once it says so.
_WORKER_STOP = {"celery": 20.0, "rq": 5.0}
_MARKER_FIELDS: dict[str, set[str]] = {"skip": {"reason"}, "output": set()}
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_LOG_TAIL_LINES = 40


class DocsError(Exception):
    """A page breaks the conventions of its examples (see the module docstring)."""


class ExampleFailed(AssertionError):
    """An example did not run as its page shows."""


@dataclass(frozen=True)
class Marker:
    """A ``<!-- test: ... -->`` line right before a fenced block.

    Attributes:
        action: ``"skip"`` (an example that does not run) or ``"output"`` (a
            text block showing what the Python block before it prints).
        fields: Its ``key="value"`` pairs.
        line: Its line number in the page.
    """

    action: str
    fields: Mapping[str, str]
    line: int

    @property
    def reason(self) -> str:
        """Why the example does not run."""
        return self.fields.get("reason", "").strip()


@dataclass(frozen=True)
class Block:
    """One fenced block of a page.

    Attributes:
        page: The page's path, relative to the repository.
        line: Line number of the block's first line of code.
        language: The fence's label.
        code: The block's text, dedented to the fence.
        marker: The marker line right before it, if any.
    """

    page: str
    line: int
    language: str
    code: str
    marker: Marker | None = None

    @property
    def kind(self) -> str:
        """``"python"``, ``"console"``, or ``""`` for a block that is not an example."""
        if self.language in PYTHON:
            return "python"
        if self.language in CONSOLE:
            return "console"
        return ""

    @property
    def location(self) -> str:
        """``page:line``, for messages."""
        return f"{self.page}:{self.line}"

    @property
    def filename(self) -> str | None:
        """The file a Python block stands for (its first line is ``# name.py``), else ``None``."""
        if self.kind != "python":
            return None
        first = self.code.split("\n", 1)[0]
        found = _FILE_BLOCK.match(first)
        return found["name"] if found else None

    @property
    def skipped(self) -> bool:
        """``True`` if its marker says it does not run."""
        return self.marker is not None and self.marker.action == "skip"

    @property
    def shows_output(self) -> bool:
        """``True`` for a text block showing what the Python block before it prints."""
        return self.marker is not None and self.marker.action == "output"


@dataclass(frozen=True)
class Command:
    """One ``$`` command of a console block and the output the page shows for it.

    Attributes:
        line: Line number of the command in the page.
        command: The command line, continuation lines joined.
        expected: The output lines shown (empty: output not checked).
        exit_status: The exit status shown, 0 unless ``(exit status N)`` says otherwise.
    """

    line: int
    command: str
    expected: tuple[str, ...]
    exit_status: int = 0

    @property
    def worker(self) -> str | None:
        """``"celery"`` or ``"rq"`` for a worker command, which runs until stopped, else ``None``.

        A ``celery ... worker`` command, or an ``rq worker`` without ``--burst``
        (a burst worker exits once the queues are empty: it runs in the foreground).
        """
        words = shlex.split(self.command, comments=True)
        program = Path(words[0]).name if words else ""
        if program == "celery" and "worker" in words[1:]:
            return "celery"
        burst = {"--burst", "-b"} & set(words)
        if program == "rq" and words[1:2] == ["worker"] and not burst:
            return "rq"
        return None

    @property
    def is_worker(self) -> bool:
        """``True`` for a worker command (see :attr:`worker`)."""
        return self.worker is not None


def visible_text(markdown: str) -> str:
    """The page's words as a reader sees them: no HTML comments, backticks or emphasis."""
    text = _COMMENT.sub(" ", markdown)
    text = re.sub(r"[`*]", "", text)
    return " ".join(text.split()).casefold()


def _parse_marker(text: str, line: int) -> Marker:
    found = _MARKER.match(text)
    if found is None:
        raise DocsError(f'line {line}: write a marker as <!-- test: skip reason="..." -->')
    action = found["action"]
    if action not in _MARKER_FIELDS:
        known = ", ".join(sorted(_MARKER_FIELDS))
        raise DocsError(f"line {line}: unknown marker action {action!r} (known: {known})")
    rest = found["fields"]
    fields = {m["key"]: m["value"] for m in _FIELD.finditer(rest)}
    if _FIELD.sub("", rest).strip():
        raise DocsError(f"line {line}: cannot read the marker's fields {rest.strip()!r}")
    unknown = set(fields) - _MARKER_FIELDS[action]
    if unknown:
        raise DocsError(f"line {line}: unknown marker field(s) {sorted(unknown)}")
    return Marker(action, fields, line)


def parse_page(page: str, text: str | None = None) -> list[Block]:
    """Every fenced block of ``page`` (relative to the repository), checked against the conventions.

    Args:
        page: The page's path relative to :data:`REPO_ROOT`, as messages name it.
        text: The page's Markdown; read from the file when omitted.

    Raises:
        DocsError: Listing every convention the page breaks.
    """
    if text is None:
        text = (REPO_ROOT / page).read_text()
    lines = text.split("\n")
    problems: list[str] = []
    blocks: list[Block] = []
    pending: Marker | None = None
    index = 0
    while index < len(lines):
        line_no = index + 1
        line = lines[index]
        if _MARKER_START.search(line):
            try:
                pending = _parse_marker(line, line_no)
            except DocsError as exc:
                problems.append(str(exc))
                pending = None
            following = lines[index + 1] if index + 1 < len(lines) else ""
            if not _FENCE.match(following):
                problems.append(f"line {line_no}: a marker must be right before a fenced block")
                pending = None
            index += 1
            continue
        opening = _FENCE.match(line)
        if opening is None:
            index += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        language = opening["info"].strip().split(" ", 1)[0].lower()
        body: list[str] = []
        index += 1
        closed = False
        while index < len(lines):
            candidate = lines[index]
            stripped = candidate.strip()
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                closed = True
                break
            # Inside a list item the block is indented with the fence; its code starts there.
            cut = len(candidate) - len(candidate.lstrip(" "))
            body.append(candidate[min(indent, cut) :])
            index += 1
        if not closed:
            problems.append(f"line {line_no}: the fenced block is never closed")
        block = Block(page, line_no + 1, language, "\n".join(body) + "\n", pending)
        pending = None
        index += 1
        if not language:
            problems.append(
                f"line {line_no}: label the block (python, console, or text for anything "
                "that is not an example)"
            )
        elif not block.kind and language not in NOT_EXAMPLES:
            problems.append(
                f"line {line_no}: unknown label {language!r}; examples are python or console, "
                f"other blocks {', '.join(sorted(NOT_EXAMPLES))}"
            )
        if block.shows_output:
            previous = blocks[-1] if blocks else None
            if language != "text" or previous is None or previous.kind != "python":
                problems.append(
                    f"line {block.marker.line}: an output marker goes on a text block right "
                    "after a Python example"
                )
        elif block.marker is not None:
            if not block.kind:
                problems.append(f"line {block.marker.line}: only examples take a skip marker")
            elif not block.marker.reason:
                problems.append(f"line {block.marker.line}: a skip marker needs a reason")
            elif block.marker.reason.casefold() not in visible_text(text):
                problems.append(
                    f"line {block.marker.line}: the page must say why the example is not run, "
                    f"in its text: {block.marker.reason!r} is not there"
                )
        if block.kind == "console":
            try:
                console_commands(block)
            except DocsError as exc:
                problems.append(str(exc))
        blocks.append(block)
    if problems:
        raise DocsError(f"{page}:\n  " + "\n  ".join(problems))
    return blocks


def examples(page: str, text: str | None = None) -> list[Block]:
    """The Python and console examples of ``page``, in page order (see :func:`parse_page`)."""
    return [block for block in parse_page(page, text) if block.kind]


def console_commands(block: Block) -> list[Command]:
    """The commands of a console block, with the output shown for each.

    Raises:
        DocsError: If the block has text before its first ``$`` command.
    """
    commands: list[Command] = []
    lines = block.code.rstrip("\n").split("\n")
    index = 0
    current: tuple[int, str] | None = None
    output: list[str] = []

    def finish() -> None:
        if current is None:
            return
        shown = list(output)
        while shown and not shown[-1].strip():
            shown.pop()
        status = 0
        if shown and (found := _EXIT_STATUS.match(shown[-1].strip())):
            status = int(found["status"])
            shown.pop()
        commands.append(Command(current[0], current[1], tuple(shown), status))

    while index < len(lines):
        line = lines[index]
        if line == "$" or line.startswith("$ "):
            finish()
            start = index
            text = line[2:]
            while text.endswith("\\") and index + 1 < len(lines):
                index += 1
                text = text[:-1] + " " + lines[index].strip()
            current, output = (block.line + start, text.strip()), []
        elif current is None:
            if line.strip():
                raise DocsError(
                    f"line {block.line + index}: a console block starts with a `$ ` command"
                )
        else:
            output.append(line)
        index += 1
    finish()
    if not commands:
        raise DocsError(f"line {block.line}: a console block without a `$ ` command")
    return commands


def _module_names(table: symtable.SymbolTable) -> set[str]:
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}


def undefined_names(code: str, known: set[str], filename: str = "<example>") -> list[str]:
    """The global names ``code`` uses, at any depth, that neither it, ``known`` nor builtins define.

    Raises:
        SyntaxError: If ``code`` is not Python.
    """
    module = symtable.symtable(code, filename, "exec")
    defined = known | _module_names(module) | set(dir(builtins)) | {"__file__", "__name__"}
    used: set[str] = set()
    tables = [module]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            if not symbol.is_referenced():
                continue
            if table is module or symbol.is_global():
                used.add(symbol.get_name())
    return sorted(used - defined)


def output_matches(expected: Sequence[str], actual: str) -> bool:
    """``True`` if ``actual`` reads as the ``expected`` lines, each ``...`` standing for any text.

    Trailing spaces and leading or trailing blank lines do not count.
    """
    pattern = "\n".join(
        ".*?".join(re.escape(part) for part in line.rstrip().split("...")) for line in expected
    )
    text = "\n".join(line.rstrip() for line in actual.strip("\n").split("\n"))
    return re.fullmatch(pattern, text, re.DOTALL) is not None


class Address:
    """Points the examples' local Redis servers at private ones.

    Args:
        port: The private server standing for the usual local Redis (port 6379).
        more: Private servers standing for further local ones, by the port a
            page names (6380 and 6381: the second and third master of a
            page that runs several).
    """

    #: The port examples name: the usual local Redis.
    SHOWN_PORT = 6379
    #: The ports of further local servers a page may name, for several masters.
    MORE_PORTS = (6380, 6381)

    def __init__(self, port: int, more: Mapping[int, int] | None = None) -> None:
        self.port = port
        self.more = dict(more or {})
        unknown = set(self.more) - set(self.MORE_PORTS)
        if unknown:
            raise ValueError(f"no example names the local port(s) {sorted(unknown)}")

    @property
    def ports(self) -> dict[int, int]:
        """The private port standing for each local port an example may name."""
        return {self.SHOWN_PORT: self.port, **self.more}

    @classmethod
    def wanted(cls, text: str) -> list[int]:
        """The further local ports (:data:`MORE_PORTS`) that ``text`` names."""
        return [
            shown
            for shown in cls.MORE_PORTS
            if re.search(rf"\b(localhost|127\.0\.0\.1):{shown}\b", text)
        ]

    def rewrite(self, text: str) -> str:
        """``text`` with ``localhost:6379``, ``127.0.0.1:6379`` and ``Redis()`` moved.

        ``localhost:6380`` and ``localhost:6381`` move too, where :attr:`more` has them.
        """
        text = self._swap(text, self.ports)
        return re.sub(r"\bRedis\(\)", f"Redis(port={self.port})", text)

    def restore(self, output: str) -> str:
        """``output`` as the page would show it: each private port back to the one shown."""
        return self._swap(output, {real: shown for shown, real in self.ports.items()})

    @staticmethod
    def _swap(text: str, ports: Mapping[int, int]) -> str:
        # One pass, so that a port written in never matches a later replacement.
        names = "|".join(str(port) for port in ports)
        return re.sub(
            rf"\b(localhost|127\.0\.0\.1):({names})\b",
            lambda found: f"{found[1]}:{ports[int(found[2])]}",
            text,
        )


# -- processes -------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat: tells a process from a later one that reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for path in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                for child in map(int, path.read_text().split()):
                    if child not in found:
                        found.append(child)
                        todo.append(child)
    return found


class Background:
    """A command running in the background, its output in a log file, stopped by its pid.

    The processes it starts (a prefork worker's pool) are remembered with
    their start times, so that only they are ever signalled.

    Args:
        argv: The command.
        cwd: Its working directory.
        env: Its whole environment.
        log_path: Where its stdout and stderr go.
    """

    def __init__(
        self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path
    ) -> None:
        self.argv = list(argv)
        self.cwd = cwd
        self.env = dict(env)
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._known: dict[int, str] = {}
        self._killed: dict[int, str] = {}

    @property
    def pid(self) -> int:
        """The main process's pid."""
        if self._proc is None:
            raise RuntimeError("not started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """``True`` while the main process lives."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Background:
        """Start the command; return ``self``."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        return self

    def log(self) -> str:
        """Everything it has written so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The log's last lines, labelled with its path."""
        tail = "\n".join(self.log().splitlines()[-lines:])
        return f"--- last {lines} lines of {self.log_path} ---\n{tail}"

    def wait_for(self, pattern: re.Pattern[str], timeout: float, *, after: int = 0) -> None:
        """Wait until the log, from offset ``after`` on, matches ``pattern``.

        Raises:
            ExampleFailed: If the command exits first, or ``timeout`` seconds pass.
        """
        deadline = time.monotonic() + timeout
        while not pattern.search(self.log()[after:]):
            if not self.running:
                raise ExampleFailed(f"{shlex.join(self.argv)} exited\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise ExampleFailed(
                    f"{shlex.join(self.argv)}: no {pattern.pattern!r} in its output after "
                    f"{timeout:g}s\n{self.log_tail()}"
                )
            time.sleep(0.05)
        self.remember_children()

    def remember_children(self) -> list[int]:
        """Note the command's live descendants; return their pids."""
        if not self.running:
            return []
        children = _descendants(self.pid)
        for pid in children:
            started = _start_time(pid)
            if started is not None:
                self._known.setdefault(pid, started)
        return children

    def kill(self) -> None:
        """SIGKILL the main process, then each remembered descendant still alive."""
        if self.running:
            self.remember_children()
            assert self._proc is not None
            self._proc.kill()
            self._proc.wait()
        self._kill_known()

    def wait_gone(self, timeout: float) -> None:
        """Wait until the descendants :meth:`kill` or :meth:`stop` signalled no longer exist.

        An orphan stays a zombie, still listed and still answering
        ``kill(pid, 0)``, until the system's init reaps it.

        Raises:
            ExampleFailed: If one is still there after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while left := [pid for pid, started in self._killed.items() if _start_time(pid) == started]:
            if time.monotonic() >= deadline:
                raise ExampleFailed(f"processes {left} still exist {timeout:g}s after SIGKILL")
            time.sleep(0.05)

    def _kill_known(self) -> None:
        for pid, started in self._known.items():
            if _start_time(pid) == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._killed[pid] = started
        # Reap nothing else: the descendants are the main process's children, not ours.
        self._known.clear()

    def stop(self, timeout: float = 20) -> int | None:
        """SIGTERM (a worker's warm shutdown), SIGKILL after ``timeout`` s; return the status."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self.remember_children()
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._kill_known()
        return proc.returncode


# -- a page's session ------------------------------------------------------------------


@dataclass
class PageSession:
    """Runs one page's examples in order, as a reader would in one directory.

    Args:
        workdir: The page's working directory (the reader's project directory).
        address: Where the examples' Redis really is.
        python: The interpreter whose ``bin`` comes first on ``PATH``; it runs
            the Python blocks too.
        timeout: Seconds one block (or one console command) may take.
    """

    workdir: Path
    address: Address
    python: str = sys.executable
    timeout: float = 60
    _driver: subprocess.Popen[str] | None = field(default=None, init=False)
    _answers: queue.Queue[str | None] = field(default_factory=queue.Queue, init=False)
    _reader: threading.Thread | None = field(default=None, init=False)
    _worker: Background | None = field(default=None, init=False)
    _worker_stop: float = field(default=20.0, init=False)
    _workers_started: int = field(default=0, init=False)

    @property
    def log_path(self) -> Path:
        """Where the Python blocks' output goes."""
        return self.workdir / "python-session.log"

    @property
    def env(self) -> dict[str, str]:
        """The environment of everything the session starts."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
        bin_dir = str(Path(self.python).parent)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
        env["PYTHONPATH"] = str(self.workdir)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def run(self, block: Block) -> str:
        """Run one example; return what a Python block printed (``""`` for console blocks).

        Raises:
            ExampleFailed: Saying where, and what happened instead.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        if block.kind == "python":
            return self.address.restore(self._run_python(block))
        if block.kind == "console":
            for command in console_commands(block):
                self._run_command(block, command)
            return ""
        raise ValueError(f"{block.location} is not an example")

    # -- Python --------------------------------------------------------------------

    def _start_driver(self) -> subprocess.Popen[str]:
        if self._driver is not None:
            return self._driver
        with self.log_path.open("ab") as log:
            driver = subprocess.Popen(
                [self.python, str(_DRIVER)],
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self._driver = driver
        self._answers = queue.Queue()
        self._reader = threading.Thread(
            target=self._read_answers, args=(driver.stdout, self._answers), daemon=True
        )
        self._reader.start()
        return driver

    @staticmethod
    def _read_answers(stream: IO[str], answers: queue.Queue[str | None]) -> None:
        with stream:
            for line in stream:
                answers.put(line)
        answers.put(None)

    def _run_python(self, block: Block) -> str:
        driver = self._start_driver()
        code = self.address.rewrite(block.code)
        if block.filename is not None:
            path = self.workdir / block.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code)
            module = block.filename[: -len(".py")].replace("/", ".")
            request: dict[str, Any] = {"op": "import", "module": module}
        else:
            request = {"op": "exec", "file": block.page, "line": block.line, "code": code}
        assert driver.stdin is not None
        driver.stdin.write(json.dumps(request) + "\n")
        driver.stdin.flush()
        try:
            raw = self._answers.get(timeout=self.timeout)
        except queue.Empty:
            self._stop_driver(kill=True)
            raise ExampleFailed(
                f"{block.location}: still running after {self.timeout:g}s\n{self._python_log()}"
            ) from None
        if raw is None:
            raise ExampleFailed(f"{block.location}: the interpreter died\n{self._python_log()}")
        answer = json.loads(raw)
        if not answer["ok"]:
            raise ExampleFailed(f"{block.location} raised:\n{answer['error']}{self._python_log()}")
        return str(answer["stdout"])

    def _python_log(self) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except FileNotFoundError:
            return ""
        return f"--- output of the Python blocks ({self.log_path}) ---\n" + "\n".join(tail)

    def _stop_driver(self, *, kill: bool = False) -> None:
        driver, self._driver = self._driver, None
        if driver is None:
            return
        if kill:
            driver.kill()
        with contextlib.suppress(OSError):
            assert driver.stdin is not None
            driver.stdin.close()
        try:
            driver.wait(10)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        if self._reader is not None:
            self._reader.join(10)
            self._reader = None

    # -- console -----------------------------------------------------------------------

    def _run_command(self, block: Block, command: Command) -> None:
        where = f"{block.page}:{command.line}"
        line = self.address.rewrite(command.command)
        if command.worker is not None:
            self._start_worker(where, line, command.worker)
            return
        try:
            done = subprocess.run(
                ["bash", "-c", line],
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=self.timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise ExampleFailed(
                f"{where}: $ {command.command} still running after {self.timeout:g}s"
            ) from exc
        output = self.address.restore(done.stdout)
        if done.returncode != command.exit_status:
            raise ExampleFailed(
                f"{where}: $ {command.command} exited with {done.returncode}, "
                f"the page shows {command.exit_status}\n{output}"
            )
        if command.expected and not output_matches(command.expected, output):
            shown = "\n".join(command.expected)
            raise ExampleFailed(
                f"{where}: $ {command.command} printed\n{output}\n--- the page shows ---\n{shown}"
            )

    def _start_worker(self, where: str, line: str, kind: str) -> None:
        if self._worker is not None:  # the reader stops the previous one (Ctrl+C) first
            self._worker.stop(self._worker_stop)
        self._workers_started += 1
        worker = Background(
            ["bash", "-c", f"exec {line}"],
            cwd=self.workdir,
            env=self.env,
            log_path=self.workdir / f"worker-{self._workers_started}.log",
        ).start()
        self._worker = worker
        self._worker_stop = _WORKER_STOP[kind]
        try:
            worker.wait_for(_WORKER_READY[kind], self.timeout)
        except ExampleFailed as exc:
            raise ExampleFailed(f"{where}: the worker did not start: {exc}") from None

    # -- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        """Stop what the session started: the interpreter, then the worker."""
        self._stop_driver()
        if self._worker is not None:
            self._worker.stop(self._worker_stop)
            self._worker = None

    def __enter__(self) -> PageSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def run_page(page: str, session: PageSession, text: str | None = None) -> Iterator[Block]:
    """Run the examples of ``page`` that are not marked, in order; yield each as it ran.

    Raises:
        DocsError: If the page breaks the conventions.
        ExampleFailed: At the first example that does not run as shown.
    """
    blocks = parse_page(page, text)
    known: set[str] = set()  # what the page's session defines so far
    for index, block in enumerate(blocks):
        if not block.kind or block.skipped:
            continue
        if block.kind == "python":
            in_reach = set() if block.filename else known
            missing = undefined_names(block.code, in_reach, block.page)
            if missing:
                raise ExampleFailed(
                    f"{block.location} uses {', '.join(missing)}, which the page never defines"
                )
            if not block.filename:
                known |= _module_names(symtable.symtable(block.code, block.page, "exec"))
        printed = session.run(block)
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        if following is not None and following.shows_output:
            shown = following.code.rstrip("\n").split("\n")
            if not output_matches(shown, printed):
                raise ExampleFailed(
                    f"{block.location} printed\n{printed}\n--- the page shows "
                    f"({following.location}) ---\n" + "\n".join(shown)
                )
        yield block
