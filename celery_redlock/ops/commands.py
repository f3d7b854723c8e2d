"""The operator commands of ``celery redlock``: list, show, release, purge and stats.

They read the lock store with ``SCAN`` (see :mod:`celery_redlock.core.inventory`)
and ask workers over Celery's remote control; none of them needs a worker of
its own. Every deletion is a compare-and-delete of the value just read, so a
lock that changed hands in between is never deleted by mistake. A semaphore
(``lock_limit`` above 1) is listed and shown permit by permit, and ``release
--permit TOKEN`` frees one permit (a compare-and-delete of that permit only).
Rate keys in use are listed and shown with ``used/limit`` (see :mod:`.rates`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import click
from celery.bin.base import CeleryCommand

from celery_redlock.calls.options import closest_option
from celery_redlock.celery.control import STATS_COMMAND
from celery_redlock.celery.stats import COUNTERS
from celery_redlock.core.inventory import (
    LockInfo,
    clients_of,
    find_locks,
    read_locks,
    semaphore_key,
)
from celery_redlock.core.reclaim import delete_permit
from celery_redlock.core.recovery import lock_prefixes
from celery_redlock.core.scripts import RELEASE
from celery_redlock.core.store import store_for

from .holders import Liveness, ReleaseOutcome, holder_liveness
from .holders import ttl_text as _ttl
from .holders import when as _when
from .permits import describe_semaphore, permit_row, release_permit_checked
from .rates import RATE_HEADER, describe_rate, find_rate_keys, rate_row, read_rate_key

__all__ = [
    "COMMANDS",
    "Liveness",
    "ReleaseOutcome",
    "holder_liveness",
    "release_checked",
]

#: Seconds a remote-control request waits for replies, unless ``--timeout`` says otherwise.
DEFAULT_TIMEOUT = 1.0


def _app(ctx: click.Context) -> Any:
    return ctx.obj.app


def _task_hint(app: Any, task: str | None) -> str:
    """A note for a ``--task`` that found nothing and is none of the app's tasks."""
    # Not an error: `singleton` functions' and RQ jobs' locks carry names the app lacks.
    if task is None or task in app.tasks:
        return ""
    names = [name for name in app.tasks if not name.startswith("celery.")]
    closest = closest_option(task, names)
    meant = f"; did you mean {closest}?" if closest else ""
    return f" ({task} is not a task of this app{meant})"


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(code)


def _dump(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def _prefixes(app: Any, given: Sequence[str]) -> list[str]:
    return list(given) or lock_prefixes(app)


def _clients(app: Any) -> list[Any]:
    return clients_of(store_for(app))


def _find(
    app: Any, prefixes: Sequence[str], task: str | None = None, queue: str | None = None
) -> list[LockInfo]:
    # On Redlock each master holds its own copy of a lock: list each key once.
    found: dict[str, LockInfo] = {}
    for client in _clients(app):
        for info in find_locks(client, prefixes, task, queue, semaphores=True):
            found.setdefault(info.key, info)
    return sorted(found.values(), key=lambda info: (info.task, info.key))


def _delete(app: Any, info: LockInfo) -> bool:
    """Compare-and-delete ``info``'s value on every master; ``True`` if any held it.

    For a semaphore, every permit read is removed (each only if still held).
    """
    if info.permits is not None:
        (client,) = _clients(app)  # semaphores never live on Redlock masters
        return sum(int(delete_permit(client, info, permit)) for permit in info.permits) > 0
    return sum(int(RELEASE(client, (info.key,), (info.value, "0"))) for client in _clients(app)) > 0


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


prefix_option = click.option(
    "--prefix",
    "prefixes",
    multiple=True,
    help="Key prefix to scan (repeatable); default: every prefix the app's settings and tasks use.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
timeout_option = click.option(
    "--timeout",
    # Zero or less would wait for no reply, and read every worker as gone.
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds to wait for workers' replies.",
)


@click.command(name="list", cls=CeleryCommand)
@click.option("--task", default=None, help="Only locks of this task name.")
@click.option("--queue", default=None, help="Only locks taken by tasks from this queue.")
@prefix_option
@json_option
@click.pass_context
def list_locks(
    ctx: click.Context,
    /,
    task: str | None,
    queue: str | None,
    prefixes: tuple[str, ...],
    as_json: bool,
    **kwargs: Any,
) -> None:
    """List the held task locks and the rate keys in use.

    A lock (or each permit of a semaphore): holder, worker, pid, acquired at,
    TTL left, renewals, fence. A rate key: used/limit, window, time until a
    slot frees, back-off left.
    """
    app = _app(ctx)
    locks = _find(app, _prefixes(app, prefixes), task, queue)
    # A rate key has no holder, so no queue: a queue filter leaves them out.
    rates = [] if queue else find_rate_keys(_clients(app), _prefixes(app, prefixes), task)
    if as_json:
        _dump([info.as_dict() for info in locks] + [info.as_dict() for info in rates])
        return
    if not locks and not rates:
        click.echo("no locks held" + _task_hint(app, task))
        return
    if locks:
        _table(_lock_rows(locks))
        click.echo(f"{len(locks)} lock(s)")
    if rates:
        _table([RATE_HEADER, *(rate_row(info) for info in rates)])
        click.echo(f"{len(rates)} rate key(s)")


def _lock_rows(locks: Sequence[LockInfo]) -> list[list[str]]:
    rows = [["TASK", "HOLDER", "NODE", "PID", "ACQUIRED (UTC)", "TTL", "RENEWALS", "FENCE", "KEY"]]
    for info in locks:
        if info.permits is not None:
            rows += [permit_row(info, permit) for permit in info.permits]
            continue
        holder = info.holder
        rows.append(
            [
                info.task,
                holder.task_id if holder else "?",
                holder.hostname if holder else "?",
                str(holder.pid) if holder else "?",
                _when(info.acquired_at),
                _ttl(info.ttl),
                "-" if info.renewals is None else str(info.renewals),
                "-" if info.fence is None else str(info.fence),
                info.key,
            ]
        )
    return rows


def _describe(info: LockInfo) -> list[tuple[str, str]]:
    holder = info.holder
    lines = [("key", info.key), ("task", info.task)]
    if holder is None:
        lines.append(("value", f"{info.value} (not written by celery-redlock)"))
    else:
        lines += [
            ("holder task id", holder.task_id),
            ("worker node", holder.hostname),
            ("host", holder.host or "-"),
            ("pid", str(holder.pid)),
            ("queue", holder.queue or "-"),
            ("acquired at", f"{_when(info.acquired_at)} UTC" if info.acquired_at else "-"),
            ("lock ttl", "-" if holder.ttl_ms is None else _ttl(holder.ttl_ms / 1000)),
        ]
    renewed = info.renewed_at
    lines += [
        ("ttl left", _ttl(info.ttl)),
        ("renewals", "-" if info.renewals is None else str(info.renewals)),
        ("last renewed", f"{_when(renewed)} UTC" if renewed else "-"),
        ("fence", "-" if info.fence is None else str(info.fence)),
    ]
    return lines


def _read_one(app: Any, key: str) -> LockInfo:
    for client in _clients(app):
        found = read_locks(client, [key]) or read_locks(
            client, [semaphore_key(key)], semaphores=True
        )
        if found:
            return found[0]
    _fail(f"no task lock at {key}")


@click.command(name="show", cls=CeleryCommand)
@click.argument("key")
@json_option
@click.pass_context
def show(ctx: click.Context, /, key: str, as_json: bool, **kwargs: Any) -> None:
    """Show one lock, semaphore or rate key in full; exit 1 if KEY holds none."""
    app = _app(ctx)
    rate = read_rate_key(_clients(app), key)
    info = _read_one(app, key) if rate is None else None
    if as_json:
        _dump(rate.as_dict() if rate is not None else info.as_dict())  # type: ignore[union-attr]
        return
    if rate is not None:
        lines = describe_rate(rate)
    else:
        assert info is not None
        lines = describe_semaphore(info) if info.permits is not None else _describe(info)
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        click.echo(f"{label.ljust(width)}  {value}")


def release_checked(
    app: Any,
    info: LockInfo,
    force: bool,
    timeout: float,
    force_hint: str = "use --force to release it anyway",
) -> ReleaseOutcome:
    """Release ``info`` if its holder is gone, or if ``force``; say what was checked.

    The holder is checked with :func:`holder_liveness`; a holder that is
    alive, or whose state cannot be told, is refused unless ``force``. The
    deletion is a compare-and-delete of the value in ``info`` on every master,
    so a lock that changed hands meanwhile is left alone. ``force_hint`` ends
    a refusal: how to force the release where the caller asks.
    """
    key, holder = info.key, info.holder
    who = f"task {holder.task_id} on {holder.hostname}" if holder else "an unknown holder"
    if info.kind == "reservation":
        liveness = Liveness(
            None,
            "an enqueue reservation names the process that published the task, whose "
            "state says nothing about the queued message",
        )
    else:
        liveness = holder_liveness(app, holder, timeout)
    if liveness.alive is not False and not force:
        state = "is alive" if liveness.alive else "may be alive"
        return ReleaseOutcome(
            False,
            True,
            f"refused: {key} is held by {who}, which {state} ({liveness.reason}); {force_hint}",
        )
    if not _delete(app, info):
        changed = f"{key} changed hands or expired meanwhile; nothing deleted"
        return ReleaseOutcome(False, False, changed)
    forced = " (forced)" if liveness.alive is not False else ""
    return ReleaseOutcome(
        True, False, f"released {key}{forced}: it was held by {who}; {liveness.reason}"
    )


@click.command(name="release", cls=CeleryCommand)
@click.argument("key")
@click.option("--force", is_flag=True, help="Release even if the holder's worker is alive.")
@click.option(
    "--permit",
    "permit_token",
    default=None,
    help="Of a semaphore (lock_limit above 1): the token of the one permit to free (see show).",
)
@timeout_option
@click.pass_context
def release(
    ctx: click.Context,
    /,
    key: str,
    force: bool,
    permit_token: str | None,
    timeout: float,
    **kwargs: Any,
) -> None:
    """Release KEY if its holder's worker is gone (pinged, and pid checked on this host).

    Refuses, with exit code 1, when the holder is alive or its state cannot be
    told, unless --force. The deletion is a compare-and-delete of the value read.
    A semaphore's permits are freed one at a time, named by --permit.
    """
    app = _app(ctx)
    info = _read_one(app, key)
    if info.permits is not None:
        if permit_token is None:
            tokens = ", ".join(p.holder.token if p.holder else p.token for p in info.permits)
            _fail(f"{key} is a semaphore; name the permit to free with --permit ({tokens})")
        (client,) = _clients(app)
        outcome = release_permit_checked(app, client, info, permit_token, force, timeout)
    elif permit_token is not None:
        _fail(f"{key} is a lock, not a semaphore: release it without --permit")
    else:
        outcome = release_checked(app, info, force, timeout)
    if not outcome.released:
        _fail(outcome.message)
    click.echo(outcome.message)


@click.command(name="purge", cls=CeleryCommand)
@click.option("--task", default=None, help="Delete the locks of this task name.")
@click.option("--all", "everything", is_flag=True, help="Delete every task lock.")
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@prefix_option
@click.pass_context
def purge(
    ctx: click.Context,
    /,
    task: str | None,
    everything: bool,
    dry_run: bool,
    yes: bool,
    prefixes: tuple[str, ...],
    **kwargs: Any,
) -> None:
    """Delete the task locks of one task (--task) or all of them (--all), held or not.

    Lists what it would delete and asks before deleting anything (--yes: does
    not ask; --dry-run: only lists). Live holders are not spared: their tasks
    go on running without a lock. The fence counter stays, so fences keep increasing.
    """
    if (task is None) == (not everything):
        raise click.UsageError("give exactly one of --task NAME or --all")
    app = _app(ctx)
    locks = _find(app, _prefixes(app, prefixes), task)
    if not locks:
        click.echo("no locks to delete" + _task_hint(app, task))
        return
    if dry_run or not yes:
        for info in locks:
            click.echo(f"would delete {_purge_line(info)}")
    if dry_run:
        click.echo(f"dry run: {len(locks)} lock(s) would be deleted; nothing was deleted")
        return
    if not yes:
        click.confirm(f"delete {len(locks)} lock(s)?", abort=True)
    deleted = 0
    for info in locks:
        if _delete(app, info):
            deleted += 1
            if yes:  # nothing was listed: say what went
                click.echo(f"deleted {_purge_line(info)}")
    changed = len(locks) - deleted
    tail = f"; {changed} had changed hands or expired and were left" if changed else ""
    click.echo(f"deleted {deleted} lock(s){tail}")


def _purge_line(info: LockInfo) -> str:
    holder = info.holder
    who = f"{holder.task_id} on {holder.hostname}" if holder else "?"
    return f"{info.key} (held by {who}, ttl {_ttl(info.ttl)})"


def _sum_stats(replies: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    totals: dict[str, dict[str, int]] = {}
    for reply in replies:
        for task, counts in (reply.get("tasks") or {}).items():
            row = totals.setdefault(task, dict.fromkeys(COUNTERS, 0))
            for name in COUNTERS:
                row[name] += int(counts.get(name, 0))
    return totals


@click.command(name="stats", cls=CeleryCommand)
@click.option(
    "--destination",
    "-d",
    "destinations",
    multiple=True,
    help="Ask only this worker node (repeatable); default: every live worker.",
)
@timeout_option
@json_option
@click.pass_context
def stats(
    ctx: click.Context,
    /,
    destinations: tuple[str, ...],
    timeout: float,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Per-task lock counts of every live worker since it started, summed over workers."""
    app = _app(ctx)
    replies = app.control.broadcast(
        STATS_COMMAND, reply=True, timeout=timeout, destination=list(destinations) or None
    )
    by_node: dict[str, dict[str, Any]] = {}
    for reply in replies or ():
        by_node.update(reply)
    counting = {node: r for node, r in by_node.items() if isinstance(r, dict) and "tasks" in r}
    silent = {node: r for node, r in by_node.items() if node not in counting}
    totals = _sum_stats(counting.values())
    if as_json:
        _dump({"workers": by_node, "totals": totals})
        return
    if not by_node:
        _fail(f"no worker answered within {timeout:g}s")
    click.echo(f"workers: {', '.join(sorted(counting)) or '(none counting)'}")
    for node, reply in sorted(silent.items()):
        click.echo(f"{node}: {reply.get('error') if isinstance(reply, dict) else reply}")
    if not totals:
        click.echo("no lock activity yet")
        return
    rows = [["TASK", *(name.upper() for name in COUNTERS)]]
    for task in sorted(totals):
        rows.append([task, *(str(totals[task][name]) for name in COUNTERS)])
    _table(rows)


#: The commands, in the order ``celery redlock --help`` lists them.
COMMANDS = (list_locks, show, release, purge, stats)
