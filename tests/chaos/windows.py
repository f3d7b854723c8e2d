"""Accounting for calls of a lock-window task: which call published a copy, which was folded.

Under ``until_and_while_executing`` with ``lock_on_duplicate="return_existing"``
a call either publishes a new copy or returns the ``AsyncResult`` of the copy
holding the reservation. The submitter names every call's task id itself, so
a returned id equal to the chosen one means "published", and any other id
means "deduplicated onto that copy". Every call is then accounted for when
each deduplicated call names a copy some earlier call published, and every
published copy ran (the history checker's no-lost-task check over the
published ids).

The second property is about the queue: a copy is *waiting* from its publish
until it is first picked up (``task_prerun``, before it takes its lock). At
most one copy of a key may be waiting at any moment.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Call", "most_waiting", "published", "unaccounted"]


@dataclass(frozen=True)
class Call:
    """One ``apply_async`` of the submitter.

    Attributes:
        resource: The resource (lock key) the call names.
        chosen: The task id the submitter passed in.
        returned: The id of the ``AsyncResult`` it got back.
        returned_at: Wall-clock time ``apply_async`` returned.
    """

    resource: str
    chosen: str
    returned: str
    returned_at: float

    @property
    def published(self) -> bool:
        """Whether this call published a new copy (rather than being folded into one)."""
        return self.returned == self.chosen


def published(calls: Iterable[Call]) -> list[Call]:
    """The calls that published a copy, in call order."""
    return [call for call in calls if call.published]


def unaccounted(calls: Sequence[Call]) -> list[str]:
    """Calls folded into a copy that no earlier call of the same resource published.

    Returns:
        One line of evidence per such call (empty when every call is accounted for).
    """
    seen: dict[str, set[str]] = defaultdict(set)
    found = []
    for call in calls:
        if call.published:
            seen[call.resource].add(call.chosen)
        elif call.returned not in seen[call.resource]:
            found.append(
                f"call {call.chosen} on {call.resource} was folded into {call.returned}, "
                "which no earlier call of that resource published"
            )
    return found


def most_waiting(calls: Sequence[Call], preruns: Iterable[tuple[str, float]]) -> dict[str, int]:
    """The largest number of copies of each resource waiting at once.

    A copy waits from its publish until its first ``task_prerun``; the publish
    is taken as the moment ``apply_async`` returned, which is after the
    reservation was made, so an overlap found here is a real one. A copy never
    picked up waits until the end.

    Args:
        calls: Every call, in call order.
        preruns: (task id, time) of every ``task_prerun`` recorded.
    """
    first_prerun: dict[str, float] = {}
    for task_id, at in preruns:
        first_prerun[task_id] = min(at, first_prerun.get(task_id, at))
    most: dict[str, int] = {}
    by_resource: dict[str, list[Call]] = defaultdict(list)
    for call in published(calls):
        by_resource[call.resource].append(call)
    for resource, copies in by_resource.items():
        spans = []
        for call in copies:
            # A worker can pick a copy up before apply_async has returned: it
            # never waited, as far as this account can tell.
            end = first_prerun.get(call.chosen, float("inf"))
            if end > call.returned_at:
                spans.append((call.returned_at, end))
        # Sweep the spans' ends and starts in time order; an end at the same
        # instant as a start counts first.
        events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
        waiting = peak = 0
        for _, change in events:
            waiting += change
            peak = max(peak, waiting)
        most[resource] = peak
    return most
