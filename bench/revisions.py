"""Two revisions of celery_redlock side by side: the lock and task hot paths, paired.

Run from the repository root, with the project's virtualenv::

    python bench/revisions.py [--old 650d4ef] [--new REV] [--rounds 5] [--calls 1000]
                              [--instructions] [--profile]

``--old`` (default ``650d4ef``, the flat layout before the layering) is checked
out into a temporary ``git worktree``, removed at the end; ``--new`` is the
working tree unless a revision is named (then it gets a temporary worktree
too). Every measurement runs ``bench/revision_probe.py`` in a subprocess whose
``PYTHONPATH`` is the tree under test; the probe reports the package's
``__file__`` and the run stops if it is not the intended tree's. Both trees run
against one private ``redis-server`` on a free loopback port (binary from
``$REDLOCK_TEST_REDIS_SERVER`` or ``PATH``), each in its own database, flushed
before each timed probe and stopped by its pid at the end.

Measures (see the probe's docstring): ``lock``, a ``Lock`` acquire + release;
``task``, an uncontended ``SingletonTask`` call run by Celery's tracer.

1. Timing: ``--rounds`` paired rounds; in each, both trees run each measure
   back to back, old first on even rounds and new first on odd ones. The probe
   times ``--blocks`` blocks of ``--calls`` calls after ``--warmup`` calls; a
   side's cost in a round is its fastest block. Reported: µs per call, the
   per-round ratios new/old (wall and CPU) and their medians.
2. ``--instructions``: each probe runs once per tree under ``valgrind
   --tool=callgrind``, counters zeroed and dumped on entry to the C function of
   ``time.process_time``, which the probe calls right before and right after
   its timed calls: the dump holds exactly those calls. Instructions are
   deterministic, so this is the stable measure on a shared, noisy machine.
3. ``--profile`` (implied when an instruction ratio exceeds ``--limit``):
   where the difference lies, as callgrind's self cost per C function
   (``callgrind_annotate``) and as bytecodes executed per Python function
   (the probe's ``--opcodes``), per call, new minus old.

Subprocesses have timeouts (``--timeout``, ``--valgrind-timeout``). The report
is printed and put into bench/RESULTS.md as its own section (``--results``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from results import write_section
from servers import free_port, redis_server_binary

BENCH = Path(__file__).resolve().parent
PROBE = BENCH / "revision_probe.py"
RESULTS_HEADING = "## Layering: old vs new hot path"
MEASURES = ("lock", "task")
SIDES = ("old", "new")
DEFAULT_OLD = "650d4ef"
# The C function behind time.process_time in CPython: callgrind zeroes its
# counters and dumps them on entry to it (see revision_probe.timed).
PROCESS_TIME_SYMBOL = "time_process_time"
MEASURED_DUMP = 2  # dump 1 is start-up and warm-up, dump 2 the timed calls


class BenchError(RuntimeError):
    """A probe failed, imported the wrong tree, or a tool is missing."""


def log(message: str) -> None:
    print(f"revisions: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Tree:
    """One side of the comparison: a source tree holding ``celery_redlock``."""

    side: str
    label: str
    path: Path

    @property
    def package(self) -> Path:
        return self.path / "celery_redlock"


@dataclass
class Timing:
    """Per-round µs per call of one measure on both sides."""

    wall_us: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SIDES})
    cpu_us: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SIDES})

    def ratios(self, kind: str) -> list[float]:
        series = self.wall_us if kind == "wall" else self.cpu_us
        return [new / old for old, new in zip(series["old"], series["new"])]


# -- trees and server -----------------------------------------------------------------


def git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@contextlib.contextmanager
def worktree(root: Path, rev: str, where: Path) -> Iterator[Path]:
    """Check ``rev`` out into a detached worktree at ``where``; remove it afterwards."""
    git(root, "worktree", "add", "--detach", "--quiet", str(where), rev)
    try:
        yield where
    finally:
        try:
            git(root, "worktree", "remove", "--force", str(where))
        except BenchError as exc:
            log(f"{exc}; deleting {where} and pruning")
            shutil.rmtree(where, ignore_errors=True)
            git(root, "worktree", "prune")


def describe(root: Path, rev: str | None) -> str:
    """A label naming the commit (and whether the working tree differs from it)."""
    if rev is not None:
        return f"{git(root, 'rev-parse', '--short', rev + '^{commit}')}"
    head = git(root, "rev-parse", "--short", "HEAD")
    dirty = git(root, "status", "--porcelain", "--", "celery_redlock")
    return f"working tree (HEAD {head}{', with uncommitted package changes' if dirty else ''})"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()  # our own child, by its pid
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def private_redis(workdir: Path) -> Iterator[str]:
    """Start a redis-server on a free loopback port; yield its URL; stop it by pid."""
    port = free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"redis-server on port {port} did not answer PING")
            time.sleep(0.05)
        client.close()
        yield url
    finally:
        _stop(proc)


# -- probes -----------------------------------------------------------------------------


def probe_env(tree: Tree) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree.path), PYTHONHASHSEED="0")
    env.pop("PYTHONSTARTUP", None)
    return env


def probe_argv(
    tree: Tree, measure: str, url: str, calls: int, warmup: int, *extra: str
) -> list[str]:
    # One database per tree: under callgrind both trees run at once, and the
    # same keys (one lock key, the same task arguments) would contend.
    db = 1 + SIDES.index(tree.side)
    argv = [sys.executable, str(PROBE), measure, "--redis-url", f"{url}/{db}"]
    return [*argv, "--calls", str(calls), "--warmup", str(warmup), *extra]


def parse_probe(tree: Tree, stdout: str, stderr: str, returncode: int) -> dict[str, Any]:
    """The probe's JSON line, after checking that it imported ``tree``'s package."""
    if returncode != 0:
        raise BenchError(f"probe of {tree.side} exited {returncode}:\n{stderr[-3000:]}")
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    imported = Path(result["package_file"]).resolve()
    if imported.parent != tree.package.resolve():
        raise BenchError(f"the {tree.side} probe imported {imported}, not {tree.package}")
    return result


def run_probe(tree: Tree, argv: list[str], cwd: Path, timeout: float) -> dict[str, Any]:
    done = subprocess.run(
        argv,
        env=probe_env(tree),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return parse_probe(tree, done.stdout, done.stderr, done.returncode)


def run_pair(
    trees: Sequence[Tree], argvs: Sequence[list[str]], cwd: Path, timeout: float
) -> list[dict[str, Any]]:
    """Run one probe per tree at the same time (for deterministic counts only)."""
    procs = [
        subprocess.Popen(
            argv,
            env=probe_env(tree),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tree, argv in zip(trees, argvs)
    ]
    deadline = time.monotonic() + timeout
    try:
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # our own child, by its pid
                proc.wait(timeout=10)
    return [
        parse_probe(tree, out, err, proc.returncode)
        for tree, proc, (out, err) in zip(trees, procs, outputs)
    ]


# -- 1. timing ------------------------------------------------------------------------------


def timing_rounds(
    trees: Sequence[Tree], url: str, args: argparse.Namespace, cwd: Path
) -> dict[str, Timing]:
    """Paired rounds: both trees back to back per measure, order alternating per round."""
    admin = redis.Redis.from_url(f"{url}/0")
    timings = {measure: Timing() for measure in MEASURES}
    extra = ("--blocks", str(args.blocks))
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for measure in MEASURES:
            for tree in order:
                admin.flushall()
                argv = probe_argv(tree, measure, url, args.calls, args.warmup, *extra)
                result = run_probe(tree, argv, cwd, args.timeout)
                blocks = result["blocks"]
                calls = result["calls"]
                timing = timings[measure]
                # Other jobs on the machine only ever add time: a process's
                # fastest block is the least disturbed one.
                wall = min(b["wall_s"] for b in blocks) / calls * 1e6
                cpu = min(b["cpu_s"] for b in blocks) / calls * 1e6
                timing.wall_us[tree.side].append(wall)
                timing.cpu_us[tree.side].append(cpu)
            t = timings[measure]
            log(
                f"round {r + 1}/{args.rounds} {measure}: old {t.wall_us['old'][-1]:.1f} µs, "
                f"new {t.wall_us['new'][-1]:.1f} µs, new/old {t.ratios('wall')[-1]:.3f}"
            )
    admin.close()
    return timings


# -- 2. instructions ------------------------------------------------------------------------


def callgrind_argv(out: Path) -> list[str]:
    return [
        "valgrind",
        "--tool=callgrind",
        "--quiet",
        f"--callgrind-out-file={out}",
        f"--zero-before={PROCESS_TIME_SYMBOL}",
        f"--dump-before={PROCESS_TIME_SYMBOL}",
    ]


def callgrind_total(path: Path) -> int:
    """The event total of a callgrind dump (its ``totals:`` or ``summary:`` line)."""
    for line in path.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise BenchError(f"{path} has no totals line")


def instruction_counts(
    trees: Sequence[Tree], url: str, args: argparse.Namespace, cwd: Path, keep: Path
) -> dict[str, dict[str, float]]:
    """Instructions per call of each measure on each side, from one callgrind run each."""
    if shutil.which("valgrind") is None:
        raise BenchError("--instructions needs valgrind on PATH")
    per_call: dict[str, dict[str, float]] = {}
    for measure in MEASURES:
        outs = [keep / f"{measure}.{tree.side}.callgrind" for tree in trees]
        argvs = [
            callgrind_argv(out)
            + probe_argv(tree, measure, url, args.instr_calls, args.instr_warmup)
            for tree, out in zip(trees, outs)
        ]
        log(f"callgrind: {measure}, {args.instr_calls} calls per tree (both trees at once)")
        results = run_pair(trees, argvs, cwd, args.valgrind_timeout)
        per_call[measure] = {}
        for tree, out, result in zip(trees, outs, results):
            dump = out.with_name(f"{out.name}.{MEASURED_DUMP}")
            if not dump.exists():
                raise BenchError(f"callgrind wrote no {dump.name}: no {PROCESS_TIME_SYMBOL}?")
            per_call[measure][tree.side] = callgrind_total(dump) / result["calls"]
        log(
            f"callgrind {measure}: old {per_call[measure]['old']:,.0f}, "
            f"new {per_call[measure]['new']:,.0f} instructions per call"
        )
    return per_call


# -- 3. profile -------------------------------------------------------------------------------

# callgrind names a recursive call's cost ``function'2``, ``function'3``, ...
_RECURSION_LEVEL = re.compile(r"'\d+$")
_COMPRESSED = re.compile(r"^\((\d+)\)(?: (.*))?$")


def _expand(value: str, names: dict[str, str]) -> str:
    """Resolve callgrind's name compression: ``(id) name`` defines, ``(id)`` refers."""
    match = _COMPRESSED.match(value)
    if not match:
        return value
    if match.group(2) is not None:
        names[match.group(1)] = match.group(2)
    return names.get(match.group(1), value)


def self_cost_by_function(dump: Path) -> Counter[str]:
    """Self instructions per C function (``file:function``, recursion levels merged).

    Read from the dump itself: cost lines under ``fn=`` are the function's own
    cost, except the line after ``calls=``, which is the callee's inclusive cost.
    (``callgrind_annotate`` on a dump taken mid-run books the inclusive cost of
    the functions on the stack at the dump as their own.)
    """
    files: dict[str, str] = {}
    functions: dict[str, str] = {}
    costs: Counter[str] = Counter()
    current, file, skip_next, total = "?", "?", False, None
    for line in dump.read_text().splitlines():
        head, _, value = line.partition("=")
        if line[:1].isdigit() or line[:1] in "+-*":
            if skip_next:
                skip_next = False
                continue
            fields = line.split()
            costs[current] += int(fields[1]) if len(fields) > 1 else 0
        elif head in ("fl", "fi", "fe", "cfi", "cfl"):
            name = _expand(value, files)
            if head == "fl":
                file = name
        elif head in ("fn", "cfn"):
            name = _expand(value, functions)
            if head == "fn":
                current = f"{os.path.basename(file)}:{_RECURSION_LEVEL.sub('', name)}"
        elif head == "calls":
            skip_next = True
        elif line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
    if total is not None and sum(costs.values()) != total:
        raise BenchError(f"{dump}: self costs add up to {sum(costs.values())}, not {total}")
    return costs


def c_function_deltas(keep: Path, measure: str, calls: int) -> list[tuple[str, float, float]]:
    """(function, old, new) self instructions per call, by the size of new - old."""
    dumps = {s: keep / f"{measure}.{s}.callgrind.{MEASURED_DUMP}" for s in SIDES}
    old, new = (self_cost_by_function(dumps[s]) for s in SIDES)
    rows = [(name, old[name] / calls, new[name] / calls) for name in set(old) | set(new)]
    return sorted(rows, key=lambda row: -abs(row[2] - row[1]))


def owner_of(filename: str, tree: Tree) -> str:
    """Where a code object comes from: a library, the stdlib, the probe or the tree."""
    path = Path(filename)
    parts = path.parts
    if "site-packages" in parts:
        return "/".join(parts[parts.index("site-packages") + 1 :])
    if path.resolve() == PROBE:
        return "bench/revision_probe.py"
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(tree.path.resolve()))
    lib = [i for i, part in enumerate(parts) if re.fullmatch(r"python3\.\d+", part)]
    if lib:
        return "/".join(("stdlib", *parts[lib[-1] + 1 :]))
    return filename  # <frozen ...>, <string>


def area(owner: str) -> str:
    """The package, a library (``celery``, ``redis`` ...), ``stdlib`` or ``bench``."""
    if owner.startswith(("stdlib/", "<frozen")):
        return "stdlib"
    if owner.startswith("<"):
        return "generated"  # <string>: code made at run time (namedtuple, dataclass)
    return owner.split("/", 1)[0].removesuffix(".py")


@dataclass
class PyFunction:
    """Bytecodes and entries per call of one Python function (or several of one name)."""

    area: str = ""
    ops: float = 0.0
    entered: float = 0.0
    paths: set[str] = field(default_factory=set)


def opcode_profile(
    trees: Sequence[Tree], measure: str, url: str, args: argparse.Namespace, cwd: Path
) -> dict[str, dict[str, PyFunction]]:
    """Per side: function -> bytecodes and entries per call.

    The package's functions are keyed by qualified name alone, so that a
    function matches itself across the move from the flat layout to the folders;
    everything else by ``path:qualname``.
    """
    profile: dict[str, dict[str, PyFunction]] = {}
    for tree in trees:
        argv = probe_argv(tree, measure, url, args.opcode_calls, args.instr_warmup, "--opcodes")
        result = run_probe(tree, argv, cwd, args.timeout)
        calls = result["calls"]
        functions: dict[str, PyFunction] = defaultdict(PyFunction)
        for where, (ops, entered) in result["opcodes"].items():
            filename, _line, qualname = where.rsplit(":", 2)
            owner = owner_of(filename, tree)
            name = area(owner)
            key = f"{name}:{qualname}" if name == "celery_redlock" else f"{owner}:{qualname}"
            function = functions[key]
            function.area = name
            function.ops += ops / calls
            function.entered += entered / calls
            function.paths.add(owner)
        for thread, ops in result["thread_ops"].items():
            functions[f"({thread} thread)"] = PyFunction(area=f"({thread} thread)", ops=ops / calls)
        profile[tree.side] = dict(functions)
    return profile


# -- report ------------------------------------------------------------------------------------


def versions() -> str:
    import celery

    server = subprocess.run(
        [redis_server_binary(), "--version"], capture_output=True, text=True, timeout=30
    ).stdout.split()
    redis_version = next((w[2:] for w in server if w.startswith("v=")), "?")
    return (
        f"CPython {platform.python_version()}, celery {celery.__version__}, "
        f"redis-py {redis.__version__}, redis-server {redis_version}"
    )


def ratio_cell(ratio: float, limit: float) -> str:
    return f"{ratio:.3f} ({(ratio - 1) * 100:+.1f} %){'' if ratio <= limit else ' **over**'}"


def instruction_lines(counts: dict[str, dict[str, float]], limit: float) -> list[str]:
    lines = [
        "### Instructions per call (callgrind; deterministic, the primary measure)",
        "",
        "| measure | old | new | new/old |",
        "|---|---:|---:|---:|",
    ]
    for measure, sides in counts.items():
        old, new = sides["old"], sides["new"]
        lines.append(f"| {measure} | {old:,.0f} | {new:,.0f} | {ratio_cell(new / old, limit)} |")
    return [*lines, ""]


def timing_lines(timings: dict[str, Timing], limit: float) -> list[str]:
    lines = [
        "### Timing, paired rounds (secondary: the machine is shared)",
        "",
        "| measure | old µs/call | new µs/call | new/old wall, median of rounds"
        " | new/old CPU, median of rounds |",
        "|---|---:|---:|---:|---:|",
    ]
    for measure, t in timings.items():
        old, new = (statistics.median(t.wall_us[s]) for s in SIDES)
        wall, cpu = (statistics.median(t.ratios(k)) for k in ("wall", "cpu"))
        lines.append(
            f"| {measure} | {old:.1f} | {new:.1f} | {ratio_cell(wall, limit)}"
            f" | {ratio_cell(cpu, limit)} |"
        )
    lines += ["", "Per-round new/old (wall; CPU):", ""]
    for measure, t in timings.items():
        wall = ", ".join(f"{x:.3f}" for x in t.ratios("wall"))
        cpu = ", ".join(f"{x:.3f}" for x in t.ratios("cpu"))
        lines.append(f"- {measure}: {wall}; {cpu}")
    return [*lines, ""]


def c_profile_lines(measure: str, rows: list[tuple[str, float, float]], top: int) -> list[str]:
    lines = [
        f"#### {measure}: self instructions per call by C function (callgrind dump)",
        "",
        "| function | old | new | new - old |",
        "|---|---:|---:|---:|",
    ]
    for name, old, new in rows[:top]:
        if abs(new - old) < 1:
            break
        lines.append(f"| `{name}` | {old:,.0f} | {new:,.0f} | {new - old:+,.0f} |")
    return [*lines, ""]


def python_profile_lines(
    measure: str, profile: dict[str, dict[str, PyFunction]], top: int
) -> list[str]:
    by_area: dict[str, Counter[str]] = {side: Counter() for side in SIDES}
    frames: dict[str, Counter[str]] = {side: Counter() for side in SIDES}
    for side in SIDES:
        for function in profile[side].values():
            by_area[side][function.area] += function.ops
            frames[side][function.area] += function.entered
    threads = sorted(name for name in by_area["old"] if name.startswith("("))
    lines = [
        f"#### {measure}: bytecodes executed per call (`revision_probe.py --opcodes`)",
        "",
        "| area | old | new | new - old | Python calls old | new |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    areas = sorted((set(by_area["old"]) | set(by_area["new"])) - set(threads))
    for name in [*areas, *threads]:
        old, new = by_area["old"][name], by_area["new"][name]
        calls = " | ".join(
            f"{frames[side][name]:g}" if name not in threads else "" for side in SIDES
        )
        lines.append(f"| {name} | {old:,.1f} | {new:,.1f} | {new - old:+,.1f} | {calls} |")
    lines += [
        "",
        "Functions whose bytecodes per call differ most (entries per call in brackets):",
        "",
        "| function | where (old; new) | old | new | new - old |",
        "|---|---|---:|---:|---:|",
    ]
    none = PyFunction()

    def get(side: str, key: str) -> PyFunction:
        return profile[side].get(key, none)

    def delta(key: str) -> float:
        return get("new", key).ops - get("old", key).ops

    keys = (set(profile["old"]) | set(profile["new"])) - set(threads)
    for key in sorted(keys, key=lambda k: (-abs(delta(k)), k))[:top]:
        if abs(delta(key)) < 0.05:
            break
        old, new = get("old", key), get("new", key)
        where = "; ".join(", ".join(sorted(f.paths)) or "-" for f in (old, new))
        qualname = key.split(":", 1)[1] if key.startswith("celery_redlock:") else key
        lines.append(
            f"| `{qualname}` | {where} | {old.ops:,.1f} ({old.entered:g}) "
            f"| {new.ops:,.1f} ({new.entered:g}) | {delta(key):+,.1f} |"
        )
    return [*lines, ""]


def render(report: dict[str, Any], args: argparse.Namespace) -> str:
    limit = 1 + args.limit / 100
    lines = [
        RESULTS_HEADING,
        "",
        f"Generated by `{report['command']}` on {report['date']}.",
        "",
        f"- old: {report['old']}; new: {report['new']}. Each tree is imported from its own "
        "path (`PYTHONPATH`, checked against the package's `__file__`) by "
        "`bench/revision_probe.py`, using only `from celery_redlock import Lock, SingletonTask`.",
        "- lock: `Lock(client, key, timeout=10)` acquire + release of one key. task: one "
        "uncontended `SingletonTask` call (distinct argument) run by Celery's `build_tracer` "
        "after `setup_worker_optimizations`, result backend disabled, `redlock_url` on a "
        "private redis-server on a loopback port (database 1 for old, 2 for new).",
        f"- {report['versions']}; load average at start {report['load'][0]}, at end "
        f"{report['load'][1]}.",
        f"- ratios are new/old costs per call (above 1 = new costs more); limit +{args.limit:g} %.",
        "",
    ]
    if report.get("instructions"):
        lines.append(
            f"Callgrind: one run per tree and measure, {args.instr_calls} calls after "
            f"{args.instr_warmup} warm-up calls and `gc.freeze()`, counted between the probe's "
            "two `time.process_time` calls (`--zero-before`/`--dump-before`), all threads, "
            "`PYTHONHASHSEED=0`; the task's `lock_ttl` is an hour, so that the watchdog's "
            "timed drops of released leases (the same code in both trees) fall outside the "
            "counted calls."
        )
        lines += ["", *instruction_lines(report["instructions"], limit)]
    lines.append(
        f"Timing: {args.rounds} paired rounds, each tree per round in its own process, order "
        f"alternating; {args.blocks} block(s) of {args.calls} calls after {args.warmup} "
        "warm-up calls per process, fastest block; the µs columns are medians over rounds."
    )
    lines += ["", *timing_lines(report["timings"], limit)]
    for measure, rows in report.get("c_profile", {}).items():
        lines += c_profile_lines(measure, rows, args.top)
    for measure, profile in report.get("python_profile", {}).items():
        lines += python_profile_lines(measure, profile, args.top)
    return "\n".join(lines).rstrip("\n") + "\n"


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default=DEFAULT_OLD, help="old revision (default %(default)s)")
    parser.add_argument("--new", default=None, help="new revision (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=5, help="paired timing rounds")
    parser.add_argument("--calls", type=int, default=1000, help="calls per timed block")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls per process")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per process")
    parser.add_argument("--instructions", action="store_true", help="count under callgrind")
    parser.add_argument("--instr-calls", type=int, default=None, help="default: --calls")
    parser.add_argument("--instr-warmup", type=int, default=100, help="warm-up under callgrind")
    parser.add_argument("--profile", action="store_true", help="always show where costs differ")
    parser.add_argument("--opcode-calls", type=int, default=100, help="calls traced by --profile")
    parser.add_argument("--limit", type=float, default=2.0, help="allowed growth in percent")
    parser.add_argument("--top", type=int, default=25, help="rows per profile table")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per probe")
    parser.add_argument("--valgrind-timeout", type=float, default=1800, help="per callgrind run")
    parser.add_argument("--keep", default=None, help="directory to keep the callgrind dumps in")
    parser.add_argument(
        "--results",
        default=str(BENCH / "RESULTS.md"),
        help="Markdown file to put the section in ('-' to skip)",
    )
    parser.add_argument("--json", default=None, help="write the raw results here")
    args = parser.parse_args(argv)
    if args.instr_calls is None:
        args.instr_calls = args.calls
    return args


def command_line(argv: list[str] | None) -> str:
    words = sys.argv[1:] if argv is None else argv
    return " ".join(["python bench/revisions.py", *words])


def measure_all(
    trees: Sequence[Tree], url: str, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    keep = Path(args.keep) if args.keep else tmp / "callgrind"
    keep.mkdir(parents=True, exist_ok=True)
    if args.instructions:
        report["instructions"] = instruction_counts(trees, url, args, tmp, keep)
    report["timings"] = timing_rounds(trees, url, args, tmp)
    limit = 1 + args.limit / 100
    for measure in MEASURES:
        counts = report.get("instructions", {}).get(measure)
        over = counts is not None and counts["new"] / counts["old"] > limit
        if not (args.profile or over):
            continue
        log(f"profiling {measure}")
        if counts is not None:
            rows = c_function_deltas(keep, measure, args.instr_calls)
            report.setdefault("c_profile", {})[measure] = rows
        profile = opcode_profile(trees, measure, url, args, tmp)
        report.setdefault("python_profile", {})[measure] = profile
    return report


def _jsonable(value: Any) -> Any:
    if isinstance(value, PyFunction):
        return {**vars(value), "paths": sorted(value.paths)}
    return str(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(git(BENCH, "rev-parse", "--show-toplevel"))
    load_start = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="revisions-")))
        old_path = stack.enter_context(worktree(root, args.old, tmp / "old"))
        new_path = root
        if args.new is not None:
            new_path = stack.enter_context(worktree(root, args.new, tmp / "new"))
        trees = (
            Tree("old", describe(root, args.old), old_path),
            Tree("new", describe(root, args.new), new_path),
        )
        (tmp / "redis").mkdir()
        url = stack.enter_context(private_redis(tmp / "redis"))
        log(f"old = {trees[0].label} at {old_path}; new = {trees[1].label} at {new_path}")
        report = measure_all(trees, url, args, tmp)
    report.update(
        command=command_line(argv),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        old=trees[0].label if trees[0].label == args.old else f"{args.old} = {trees[0].label}",
        new=trees[1].label,
        versions=versions(),
        load=(load_start, "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())),
    )
    section = render(report, args)
    print(section)
    if args.results != "-":
        write_section(Path(args.results), RESULTS_HEADING, section)
    if args.json:
        raw = {k: v for k, v in report.items() if k != "timings"}
        raw["timings"] = {m: vars(t) for m, t in report["timings"].items()}
        Path(args.json).write_text(json.dumps(raw, indent=1, default=_jsonable))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (BenchError, subprocess.TimeoutExpired) as exc:
        log(f"error: {exc}")
        sys.exit(1)
