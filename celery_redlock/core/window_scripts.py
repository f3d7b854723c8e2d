"""The enqueue windows' Lua scripts: reserve a call before publishing, and hand it over.

A task in an enqueue window (``until_executing``, ``until_executed``,
``until_and_while_executing``) reserves its key when it is published and the
worker takes the reservation back, or turns it into the execution lock, when
the task starts. Each script documents its KEYS, ARGV and replies; they run
through :class:`~celery_redlock.core.lua.Script` like the lock's own.
"""

from __future__ import annotations

from .lua import Script

__all__ = ["CANCEL_RESERVE", "DEQUEUE", "DRAW_FENCE", "HANDOVER", "RESERVE"]

#: Lua drawing the next fence of a lock just taken: ``INCR`` of the fence key
#: (``KEYS[2]``), seeded from the server clock when the key was gone so fences
#: still rise after it expired, and kept ``ARGV[3]`` ms from this use. Every
#: script that takes an execution lock from a reservation or a generation
#: draws it this way, so the fences of one key rise whichever script took it.
#: Leaves the fence in the local ``fence``.
DRAW_FENCE = """local fence = redis.call('INCR', KEYS[2])
if fence == 1 then
  local now = redis.call('TIME')
  fence = tonumber(now[1]) * 1000000 + tonumber(now[2])
  redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', ARGV[3])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
"""

# Enqueue lock: reserve a call's key before its message is published.
#
# KEYS[1]  reservation key
# KEYS[2]  (optional) its cancel key, same hash slot: see CANCEL_RESERVE
# ARGV[1]  value to store (the new message's holder value)
# ARGV[2]  ttl in milliseconds (> 0)
# ARGV[3]  a value this reservation may replace ("" for none): the one held by
#          the message being republished (retry, requeue), so a task can renew
#          its own reservation while a duplicate still cannot take it
# Returns  1 when stored; 0 when the caller had already cancelled this value;
#          otherwise the table {holder's PTTL in ms, holder's value}.
RESERVE = Script(
    "reserve",
    """
if KEYS[2] and redis.call('GET', KEYS[2]) == ARGV[1] then
  return 0
end
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] and (ARGV[3] == '' or current ~= ARGV[3]) then
  return {redis.call('PTTL', KEYS[1]), current}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
""",
)

# Take back a RESERVE whose reply never came (a timeout): it may have run, or may
# still be waiting to run behind other commands, possibly on another connection.
#
# KEYS[1]  reservation key
# KEYS[2]  its cancel key (same hash slot)
# ARGV[1]  the value that RESERVE sent
# ARGV[2]  the value to put back if it did run ("" to delete the key)
# ARGV[3]  ttl in milliseconds of the value put back
# ARGV[4]  how long the cancel key stays, in milliseconds (> 0)
# Returns  1 when the reservation had been stored and is now undone; 0 when it
#          was not there: the cancel key then makes a late RESERVE of that value
#          a no-op.
CANCEL_RESERVE = Script(
    "cancel_reserve",
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[2] == '' then
    redis.call('DEL', KEYS[1])
  else
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  end
  return 1
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4])
return 0
""",
)

# Worker start of an until_executing task: drop its reservation, or name who holds it.
#
# KEYS[1]  reservation key
# ARGV[1]  the reservation value the message carries ("" for none)
# Returns  1 when the reservation was this message's and is now deleted; 0 when
#          there is none (lapsed, or the message bypassed apply_async); otherwise
#          the table {holder's PTTL in ms, holder's value}: another copy is queued.
DEQUEUE = Script(
    "dequeue",
    """
local current = redis.call('GET', KEYS[1])
if not current then
  return 0
end
if current == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return {redis.call('PTTL', KEYS[1]), current}
""",
)

# Worker start of an until_executed or until_and_while_executing task: turn the
# message's reservation into the execution lock in one step, so no duplicate can
# be enqueued or start in between, and draw a fence as ACQUIRE does.
#
# KEYS[1]  lock key
# KEYS[2]  fence counter (see fences.fence_key_for; same hash slot as the lock key)
# KEYS[3]  reservation key: the lock key itself (until_executed) or its
#          ":queued" sibling (until_and_while_executing, same hash slot)
# ARGV[1]  token of the execution lock
# ARGV[2]  ttl in milliseconds (> 0)
# ARGV[3]  lifetime of the fence counter from its latest draw, in milliseconds
# ARGV[4]  the reservation value the message carries ("" for none)
# Returns  {1, fence, found} when the lock was taken; found is 1 when the
#          message's reservation was still there (and is now replaced or
#          deleted), 0 when it had lapsed or never existed.
#          {0, holder's PTTL in ms, holder's value, found} when another holder
#          has the lock key; the reservation is then left as it is.
HANDOVER = Script(
    "handover",
    """
local found = 0
if ARGV[4] ~= '' and redis.call('GET', KEYS[3]) == ARGV[4] then
  found = 1
end
local current = redis.call('GET', KEYS[1])
local ours = current == ARGV[1] or (found == 1 and KEYS[3] == KEYS[1])
if current and not ours then
  return {0, redis.call('PTTL', KEYS[1]), current, found}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if found == 1 and KEYS[3] ~= KEYS[1] then
  redis.call('DEL', KEYS[3])
end
"""
    + DRAW_FENCE
    + """return {1, fence, found}
""",
)
