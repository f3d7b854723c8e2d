"""RQ: enqueue a call unless an identical one (same lock key) is queued, scheduled or running.

See :func:`enqueue_once` (and, for the windows that keep the newest call or
limit by time, :mod:`celery_redlock.rq.windows`). Importing this module needs ``rq``.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job

from celery_redlock.calls.options import Mode
from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.keys import KeyBuilder
from celery_redlock.core.lua import Script

from .windows import enqueue_newest, enqueue_period, window_options

__all__ = ["CLAIM", "enqueue_once"]

# Claim the enqueue marker of a lock key, unless it names a live job.
#
# KEYS[1]  marker key (the lock key + ":enqueued")
# ARGV[1]  id of the job the caller is about to enqueue
# ARGV[2]  key prefix of RQ job hashes ("rq:job:")
# ARGV[3]  marker lifetime in milliseconds
# ARGV[4]  grace in milliseconds: a claimed id whose job hash does not exist
#          yet counts as being enqueued for this long
# Returns  the id of the live job to reuse, or nil when the marker now names ARGV[1].
#
# A job is live in every status but the four it ends in, so statuses RQ adds
# (RQ 3's rate_limited and ready_to_enqueue) count as live without a change here.
# The marker value is "<job id>|<claim time in ms>". Job hashes are read by a
# key built here, which Redis Cluster would refuse; RQ does not run on Cluster.
CLAIM = Script(
    "rq_enqueue_claim",
    """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local current = redis.call('GET', KEYS[1])
if current then
  local id, claimed = string.match(current, '^(.*)|(%d+)$')
  if id then
    local status = redis.call('HGET', ARGV[2] .. id, 'status')
    if status then
      if status ~= 'finished' and status ~= 'failed' and status ~= 'stopped'
          and status ~= 'canceled' then
        return id
      end
    elseif now_ms - tonumber(claimed) < tonumber(ARGV[4]) then
      return id
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. string.format('%d', now_ms), 'PX', ARGV[3])
return false
""",
)


# long because: most of it is the docstring of its options and guarantees
def enqueue_once(
    queue: Queue,
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    marker_ttl: float = 86400.0,
    grace: float = 10.0,
    mode: str = "until_executed",
    period: float | None = None,
    debounce: float | None = None,
    debounce_max_wait: float | None = None,
    keep: str = "first",
    **enqueue_options: Any,
) -> Job:
    """Enqueue ``func(*args, **kwargs)`` unless an identical call is queued or running.

    Two calls are identical when they have the same lock key: for a
    :func:`singleton_job` function its own key options, otherwise all arguments.
    A job that is queued, scheduled (for instance requeued by its lock),
    deferred or started counts, and so does one RQ 3 holds back under its own
    ``rate_limit`` (``rate_limited``, ``ready_to_enqueue``): any state but
    finished, failed, stopped or canceled. The check and the claim are one
    atomic script, so concurrent callers get one job between them.

    Args:
        queue: The RQ queue.
        func: The job function.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        marker_ttl: Seconds the enqueue marker lives; a job still queued after
            that no longer deduplicates.
        grace: Seconds a claimed job id counts as being enqueued before its job
            hash exists (covers the caller between claim and enqueue).
        mode: ``"until_executed"`` (the above), ``"until_expired"`` (``period``),
            ``"debounce"`` (``debounce``, ``debounce_max_wait``) or
            ``"until_and_while_executing"`` with ``keep="latest"``: see
            :mod:`celery_redlock.rq.windows` and docs/modes.md.
        period: Seconds an accepted call refuses identical ones (``until_expired``).
        debounce: Quiet seconds before a debounced burst runs its newest call.
        debounce_max_wait: Longest a debounced burst waits from its first call.
        keep: ``"latest"``: a newer call replaces the waiting job.
        **enqueue_options: Passed to ``Queue.enqueue_call`` (``job_timeout`` as
            ``timeout``, ``result_ttl``, ``meta``...); not ``job_id``.

    Returns:
        The new job, or the live identical one.

    Raises:
        ConfigurationError: If ``enqueue_options`` sets ``job_id``, or a window
            option is bad (naming it).
    """
    if "job_id" in enqueue_options:
        raise ConfigurationError("job_id", enqueue_options["job_id"], "enqueue_once picks the id")
    window = window_options(mode, period, debounce, debounce_max_wait, keep)
    kwargs = dict(kwargs or {})
    key_for = getattr(func, "lock_key_for", None)
    if key_for is None:
        name = f"{func.__module__}.{func.__qualname__}"
        key_for = functools.partial(_default_key, KeyBuilder(name, func, None, "redlock"))
    key = key_for(*args, **kwargs)
    if window.period is not None:
        return enqueue_period(queue, func, (args, kwargs), key, window.period, enqueue_options)
    if window.mode is not Mode.UNTIL_EXECUTED:
        return enqueue_newest(queue, func, (args, kwargs), key, window, enqueue_options)
    marker = f"{key}:enqueued"
    prefix = queue.job_class.key_for("")
    deadline = time.monotonic() + grace + 1.0
    while True:
        new_id = uuid.uuid4().hex
        existing = CLAIM(
            queue.connection,
            (marker,),
            (new_id, prefix, int(marker_ttl * 1000), int(grace * 1000)),
        )
        if existing is None:
            return queue.enqueue_call(
                func, args=tuple(args), kwargs=kwargs, job_id=new_id, **enqueue_options
            )
        existing_id = existing.decode() if isinstance(existing, bytes) else str(existing)
        try:
            return queue.job_class.fetch(existing_id, connection=queue.connection)
        except NoSuchJobError:
            # Claimed by a caller that is enqueueing it right now (or died
            # doing so, and the claim lapses after the grace): look again.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _default_key(keys: KeyBuilder, *args: Any, **kwargs: Any) -> str:
    return keys.key_for(args, kwargs)
