"""What celery-redlock writes into a task's message headers, and how a worker reads it back.

Headers travel with the message, so they are how one delivery tells the next
why it was published: a requeue counts itself, a copy that met its own lock
marks itself, a reserved call carries its reservation's value, and a retry
says it continues a call that already ran.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CONTINUES_HEADER",
    "GENERATION_HEADER",
    "QUEUE_HEADER",
    "REQUEUES_HEADER",
    "RESERVATION_HEADER",
    "SELF_HEADER",
    "header_of",
    "place_of",
    "requeues_of",
]

#: Message header counting how often the lock sent this message back to the queue:
#: ``[retries, count]``, so that a Celery retry (which copies the headers) starts
#: its own count.
REQUEUES_HEADER = "x_redlock_requeues"
#: Message header set when a copy was requeued because it met its own task id.
SELF_HEADER = "x_redlock_self"
#: Message header carrying the value of the message's reservation.
RESERVATION_HEADER = "x_redlock_reservation"
#: Message header set on a retry (and kept by its requeues): the message
#: continues a call that already ran, so the worker never drops it as a
#: duplicate, whatever reservation it does or does not carry.
CONTINUES_HEADER = "x_redlock_continues"
#: Message header of a call in a window that keeps the newest (``debounce``,
#: ``keep="latest"``): ``"<epoch>:<generation>"`` of its key when it was
#: published; an older generation retires itself at the worker.
GENERATION_HEADER = "x_redlock_generation"


#: Message header of a call waiting in line (see core/queue_scripts.py):
#: ``[retries, arrival in microseconds, rank, server ms]`` of its latest refusal,
#: so its place survives requeues and its next countdown can judge the pace.
QUEUE_HEADER = "x_redlock_queue"


def place_of(request: Any) -> tuple[int, int, int] | None:
    """The (arrival, rank, server ms) of this attempt's latest place in line, if any."""
    value = header_of(request, QUEUE_HEADER)
    if isinstance(value, (list, tuple)) and len(value) == 4 and value[0] == (request.retries or 0):
        return int(value[1]), int(value[2]), int(value[3])
    return None


def requeues_of(request: Any) -> int:
    """How often the lock requeued this attempt of a task (0 after a Celery retry)."""
    value = header_of(request, REQUEUES_HEADER)
    if isinstance(value, (list, tuple)) and len(value) == 2:
        retries, count = value
        return int(count) if retries == (request.retries or 0) else 0
    return int(value or 0)  # a message requeued by an earlier version


def header_of(request: Any, name: str) -> Any:
    """Return message header ``name`` of a task request (or the request attribute of that name)."""
    headers = request.headers or {}
    return headers.get(name, getattr(request, name, None))
