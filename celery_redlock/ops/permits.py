"""A semaphore's permits as the ``celery redlock`` commands list, show and release them.

A semaphore (``lock_limit`` above 1) has one permit per holder; each is
listed on a row of its own, shown with its holder, and released on its own
(``release KEY --permit TOKEN``) by a compare-and-delete of that permit only.
"""

from __future__ import annotations

from typing import Any

from celery_redlock.core.inventory import LockInfo, PermitInfo
from celery_redlock.core.reclaim import delete_permit

from .holders import ReleaseOutcome, holder_liveness, ttl_text, when

__all__ = ["describe_semaphore", "permit_row", "release_permit_checked"]


def permit_row(info: LockInfo, permit: PermitInfo) -> list[str]:
    """The row of ``list`` for one permit of semaphore ``info`` (the columns of a lock's)."""
    holder = permit.holder
    acquired = holder.acquired_ms / 1000 if holder is not None and holder.acquired_ms else None
    return [
        info.task,
        holder.task_id if holder else permit.token,
        holder.hostname if holder else "?",
        str(holder.pid) if holder else "?",
        when(acquired),
        ttl_text(permit.ttl),
        "-",
        str(permit.fence),
        f"{info.key} (permit {permit.slot})",
    ]


def _permit_lines(permit: PermitInfo) -> list[tuple[str, str]]:
    holder = permit.holder
    lines = [(f"permit {permit.slot}", f"fence {permit.fence}, ttl left {ttl_text(permit.ttl)}")]
    if holder is None:
        return [*lines, ("  token", f"{permit.token} (not written by celery-redlock)")]
    acquired = holder.acquired_ms / 1000 if holder.acquired_ms else None
    return [
        *lines,
        ("  token", holder.token),
        ("  holder task id", holder.task_id),
        ("  worker node", holder.hostname),
        ("  host", holder.host or "-"),
        ("  pid", str(holder.pid)),
        ("  queue", holder.queue or "-"),
        ("  acquired at", f"{when(acquired)} UTC" if acquired else "-"),
    ]


def describe_semaphore(info: LockInfo) -> list[tuple[str, str]]:
    """The (label, value) lines ``show`` prints for semaphore ``info``, permit by permit."""
    permits = info.permits or ()
    lines = [
        ("key", info.key),
        ("task", info.task),
        ("kind", f"semaphore, {len(permits)} permit(s) held"),
        ("fence", "-" if info.fence is None else str(info.fence)),
    ]
    for permit in permits:
        lines += _permit_lines(permit)
    return lines


def release_permit_checked(
    app: Any, client: Any, info: LockInfo, token: str, force: bool, timeout: float
) -> ReleaseOutcome:
    """Free the permit of semaphore ``info`` whose token is ``token``, checked as a lock is.

    ``token`` is the holder's token that ``show`` prints (or the permit's
    whole member). Only that permit is removed, and only if it is still held.
    """
    permits = info.permits or ()
    permit = next(
        (p for p in permits if token in (p.member, p.token, p.holder and p.holder.token)), None
    )
    if permit is None:
        return ReleaseOutcome(False, False, f"{info.key} holds no permit with token {token}")
    holder = permit.holder
    who = f"task {holder.task_id} on {holder.hostname}" if holder else "an unknown holder"
    liveness = holder_liveness(app, holder, timeout)
    if liveness.alive is not False and not force:
        state = "is alive" if liveness.alive else "may be alive"
        return ReleaseOutcome(
            False,
            True,
            f"refused: permit {permit.slot} of {info.key} is held by {who}, which {state} "
            f"({liveness.reason}); use --force to release it anyway",
        )
    if not delete_permit(client, info, permit):
        changed = f"permit {permit.slot} of {info.key} expired or was released meanwhile"
        return ReleaseOutcome(False, False, f"{changed}; nothing deleted")
    forced = " (forced)" if liveness.alive is not False else ""
    return ReleaseOutcome(
        True,
        False,
        f"released permit {permit.slot} of {info.key}{forced}: it was held by {who}; "
        f"{liveness.reason}",
    )
