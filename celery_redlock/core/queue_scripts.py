"""Fair admission: the waiting calls of a key, kept in the script that takes the key.

A call that is refused and comes back later (Celery's ``lock_on_conflict=
"requeue"``) keeps its place in a per-key wait list, so the oldest waiter is
admitted first when the key frees and later arrivals queue behind it. The
wait list is the semaphore's (:class:`~celery_redlock.core.semaphore_scripts.
SemaphoreKeys`): two sorted sets beside the name, in its Cluster hash slot,

``<name>:waiters``
    Waiters by first arrival (server clock in microseconds). A requeued call
    carries its arrival in its message, so it keeps its place across requeues
    and comes back to it if its entry lapsed meanwhile.
``<name>:waiting``
    The same waiters by when their entry lapses (milliseconds). Each attempt
    renews its entry; a waiter that stops coming (revoked, expired, lost) is
    pruned once its entry lapses.
``<name>:present``
    The same waiters by until when they count as present (milliseconds): a
    waiter is present from an attempt until its next attempt is due (a short
    poll when it is next, plus a grace for a busy worker). A free key goes to
    the oldest *present* waiter: one asleep on a long countdown keeps its place
    for when it comes back, but does not hold the key idle meanwhile.

A lock is taken by :data:`FAIR_ACQUIRE` (the lock's own ACQUIRE script run
inside it, whatever ACQUIRE does); a semaphore permit by ACQUIRE_PERMIT with
a :class:`Place`. Both cost one round trip, and with nobody waiting one
``ZCARD`` of a missing key more than the plain acquire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .lock_options import key_beside
from .lua import Arg, Script
from .scripts import ACQUIRE
from .semaphore_scripts import semaphore_keys

__all__ = ["FAIR_ACQUIRE", "LEAVE_LINE", "Place", "queue_keys"]

# Leave the line: a call that will not come back (it ran out of requeues).
#
# KEYS     the line's three sets (queue_keys)
# ARGV[1]  the member
# Returns  1 when it was in line, 0 otherwise. Safe to send twice.
LEAVE_LINE = Script(
    "leave_line",
    """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
""",
)


@dataclass(frozen=True)
class Place:
    """A call's place in the wait list of a key.

    Attributes:
        member: Who waits: the call's id (the same across its requeues and redeliveries).
        arrival_us: When the call first arrived (server clock, microseconds),
            or ``None`` for a call that has not waited yet: the server's
            clock at its first refusal is its arrival then.
        near_ms: How long the call counts as present after an attempt: the
            poll of a call that is next, plus the time a worker may take to
            run it again.
        far_ms: How long its entry lasts after an attempt (its longest
            countdown plus that grace): a call gone for longer gives up its place.
    """

    member: str
    arrival_us: int | None
    near_ms: int
    far_ms: int

    def args(self) -> tuple[str, str, int, int]:
        """The four ARGV entries of the place, in the scripts' order."""
        arrival = "" if self.arrival_us is None else str(self.arrival_us)
        return (self.member, arrival, self.near_ms, self.far_ms)


def queue_keys(name: str) -> tuple[str, str, str]:
    """The wait line of ``name``: (waiters by arrival, by lapse, by presence)."""
    keys = semaphore_keys(name)
    return keys.waiters, keys.waiting, key_beside(name, "present")


def _fair_again(args: Sequence[Arg]) -> Sequence[Arg]:
    # ACQUIRE's own resend rule (its ARGV[4]) for the leading arguments; the
    # place is the same whichever way the first send went.
    return (*args[:3], "1", *args[4:])


# Take a lock (scripts.ACQUIRE) only when no older waiter is in line; else join the line.
#
# KEYS     ACQUIRE's keys, then: waiters by arrival, by lapse, by presence
# ARGV     ACQUIRE's arguments (ARGV[5] included, "0" when unused), then:
#          member (the call's id), arrival in microseconds ("": now), near ms
#          (how long it counts as present) and far ms (how long its entry lasts)
# Returns  ACQUIRE's fence when the lock was taken (the member leaves the
#          line); otherwise {holder's PTTL in ms (-2: the key is free but an
#          older waiter is next), holder's value (false: none), the member's
#          rank (0: next), waiters in line, the member's arrival in
#          microseconds, the server clock in ms}. The key is taken only when no
#          waiter ahead in line is present (attempted within its near ms).
#
# The place arguments are taken off the end of KEYS and ARGV before ACQUIRE's
# text runs, so ACQUIRE sees exactly its own KEYS and ARGV. With nobody in
# line this is ACQUIRE plus one ZCARD.
_PRELUDE = """
local far = tonumber(table.remove(ARGV))
local near = tonumber(table.remove(ARGV))
local arrival = table.remove(ARGV)
local member = table.remove(ARGV)
local present_key = table.remove(KEYS)
local lapse_key = table.remove(KEYS)
local line_key = table.remove(KEYS)
local queued = redis.call('ZCARD', line_key)
local acquire = function()
"""

_AFTER = """
end
-- ARGV[4] "1": a resend whose first send may have taken the lock (and left the
-- line): only our own token found there is ours; a free key is taken in turn below.
if queued == 0 or (ARGV[4] == '1' and redis.call('GET', KEYS[1]) == ARGV[1]) then
  local taken = acquire()
  if type(taken) == 'number' then
    if queued > 0 then
      redis.call('ZREM', line_key, member)
      redis.call('ZREM', lapse_key, member)
      redis.call('ZREM', present_key, member)
    end
    return taken
  end
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
if queued > 0 then
  for _, waiter in ipairs(redis.call('ZRANGEBYSCORE', lapse_key, '-inf', now)) do
    redis.call('ZREM', line_key, waiter)
    redis.call('ZREM', lapse_key, waiter)
    redis.call('ZREM', present_key, waiter)
  end
  local rank = redis.call('ZRANK', line_key, member)
  local ahead = rank or redis.call('ZCARD', line_key)
  local first = true
  if ahead > 0 then
    for _, waiter in ipairs(redis.call('ZRANGE', line_key, 0, ahead - 1)) do
      if tonumber(redis.call('ZSCORE', present_key, waiter) or '0') > now then
        first = false
        break
      end
    end
  end
  if first then
    local taken = acquire()
    if type(taken) == 'number' then
      redis.call('ZREM', line_key, member)
      redis.call('ZREM', lapse_key, member)
      redis.call('ZREM', present_key, member)
      return taken
    end
  end
end
if arrival == '' then
  arrival = string.format('%d', tonumber(clock[1]) * 1000000 + tonumber(clock[2]))
end
redis.call('ZADD', line_key, 'LT', arrival, member)
local rank = redis.call('ZRANK', line_key, member)
redis.call('ZADD', lapse_key, now + far, member)
redis.call('ZADD', present_key, now + near, member)
for _, key in ipairs({line_key, lapse_key, present_key}) do
  if redis.call('PTTL', key) < far then
    redis.call('PEXPIRE', key, far)
  end
end
local pttl = redis.call('PTTL', KEYS[1])
local holder = redis.call('GET', KEYS[1])
return {pttl, holder, rank, redis.call('ZCARD', line_key),
        redis.call('ZSCORE', line_key, member), now}
"""

# The script itself: the prelude above, ACQUIRE's text as a function, then the line.
FAIR_ACQUIRE = Script("fair_acquire", _PRELUDE + ACQUIRE.source + _AFTER, resend=_fair_again)
