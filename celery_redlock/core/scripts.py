"""The lock's Lua scripts: acquire with a fence, release, renew, and raise a Redlock fence.

Each script documents its KEYS, ARGV and replies, and how it is sent again
after a connection error (see :class:`~celery_redlock.core.lua.Script`, which
runs them). The enqueue windows' scripts are in
:mod:`celery_redlock.core.window_scripts`; both stay importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence

from .lua import Arg, Script
from .window_scripts import CANCEL_RESERVE, DEQUEUE, HANDOVER, RESERVE

__all__ = [
    "ACQUIRE",
    "CANCEL_RESERVE",
    "DEQUEUE",
    "HANDOVER",
    "RAISE_FENCE",
    "RELEASE",
    "RELEASE_HELD_BY",
    "RENEW",
    "RESERVE",
    "Arg",
    "Script",
]


def _acquire_again(args: Sequence[Arg]) -> Sequence[Arg]:
    # The first send may have taken the lock: let the resend find it ours.
    return (*args[:3], "1", *args[4:])


# Take the lock and draw a fence in one round trip.
#
# KEYS[1]  lock key
# KEYS[2]  fence counter (see fences.fence_key_for: one per store, or per hash
#          slot on Cluster, so in the lock key's slot)
# ARGV[1]  token
# ARGV[2]  ttl in milliseconds; "0" means the lock never expires
# ARGV[3]  lifetime of the fence counter from its latest draw, in milliseconds
# ARGV[4]  "0" on the first send; "1" when this same acquisition is sent again
#          after its reply was lost (see Script), so it may find ARGV[1] held
# ARGV[5]  (optional) "1": no fence below the server clock in microseconds
#          (replicated acquisition, see below)
# Returns  the fence (an integer > 0) when the lock was taken (or, with ARGV[4]
#          "1", already held with ARGV[1]), otherwise the table
#          {holder's PTTL in ms (-1: no expiry), holder's value}.
#
# Every name of a store (of a slot, on Cluster) draws from one counter. It only
# grows, so each name's fences strictly increase, and the store keeps one key
# for fences however many names it has seen.
#
# Fences count up from a seed: the server clock in microseconds, taken when the
# counter is missing (first use, unused for ARGV[3] ms, evicted, or a restart
# that lost it). The seed exceeds every fence handed out before, because the
# counter advances one per draw and no store draws a million fences a second:
# from any seed, the counter stays behind the clock. So the counter may expire
# or be lost and fences still increase. Each draw renews its expiry, so a store
# in use never reseeds: in steady state the fence is a plain INCR, which keeps
# fences strictly increasing even if the server clock steps back.
#
# With ARGV[5] "1" every fence is also at least the server clock in
# microseconds. A replica promoted by a failover may hold a counter behind the
# old master's (draws that never replicated): its first fences then start from
# its clock, above every fence handed out before the failover, instead of
# repeating them.
ACQUIRE = Script(
    "acquire",
    """
local ttl = tonumber(ARGV[2])
local taken
if ttl > 0 then
  taken = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ttl)
else
  taken = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if not taken then
  local holder = redis.call('GET', KEYS[1])
  if holder ~= ARGV[1] or ARGV[4] ~= '1' then
    return {redis.call('PTTL', KEYS[1]), holder}
  end
  -- Our own token on a resend: this very acquisition ran before and its reply
  -- was lost. It is ours; restart its TTL and go on. On a first send the same
  -- token is another acquirer's (callers may choose tokens): refused.
  if ttl > 0 then
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
end
local fence = redis.call('INCR', KEYS[2])
local floor = 0
if fence == 1 or ARGV[5] == '1' then
  local now = redis.call('TIME')
  floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
end
if fence < floor then
  fence = floor
  redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', ARGV[3])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return fence
""",
    resend=_acquire_again,
)


def _release_again(args: Sequence[Arg]) -> Sequence[Arg]:
    # The first send most likely deleted the key: a missing key is released.
    return (args[0], "1")


# Delete the lock only if it still holds our token.
#
# KEYS[1]  lock key
# ARGV[1]  token
# ARGV[2]  "0" on the first send; "1" when the same release is sent again after
#          its reply was lost (see Script): a missing key then counts as deleted
# Returns  1 when the lock was ours and is now deleted (or, with ARGV[2] "1",
#          is missing), 0 otherwise.
RELEASE = Script(
    "release",
    """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
if not holder and ARGV[2] == '1' then
  return 1
end
return 0
""",
    resend=_release_again,
    check_connection=True,
)

# Delete a lock whose value names a given holder; for a worker cleaning up after
# a pool process it killed, which cannot release its own lock any more.
#
# KEYS[1]  lock key
# ARGV[1]  the holder's fragment of the value (see holder.Holder.fragment)
# Returns  1 when the lock named that holder and is now deleted, 0 otherwise.
RELEASE_HELD_BY = Script(
    "release_held_by",
    """
local value = redis.call('GET', KEYS[1])
if value and string.find(value, ARGV[1], 1, true) then
  return redis.call('DEL', KEYS[1])
end
return 0
""",
)


def _renew_again(args: Sequence[Arg]) -> Sequence[Arg] | None:
    # Setting a TTL twice sets it once; adding twice adds twice.
    return args if args[0] in ("1", b"1") else None


# Push back the expiry of any number of locks, each only if it holds our token.
# One call serves extend(), reacquire() and the watchdog's batched renewals.
#
# KEYS[i]      lock keys
# ARGV[1]      "1": set each TTL to its milliseconds; "0": add them to the TTL left
# ARGV[2i]     token of KEYS[i]
# ARGV[2i+1]   milliseconds for KEYS[i]
# Returns      a table with, for each key, its new PTTL in ms, or 0 when the key
#              does not hold our token (or, when adding, has no expiry to add to).
#
# After a lost reply (see Script) a call that sets TTLs is sent again as it is;
# one that adds is not, and its caller gets the connection error.
RENEW = Script(
    "renew",
    """
local replace = ARGV[1] == '1'
local result = {}
for i, key in ipairs(KEYS) do
  local ms = tonumber(ARGV[2 * i + 1])
  result[i] = 0
  if redis.call('GET', key) == ARGV[2 * i] then
    if not replace then
      local left = redis.call('PTTL', key)
      if left < 0 then
        ms = nil
      else
        ms = ms + left
      end
    end
    if ms then
      redis.call('PEXPIRE', key, ms)
      result[i] = ms
    end
  end
end
return result
""",
    resend=_renew_again,
    check_connection=True,
)

# Redlock: raise one master's fence counter to the fence about to be handed out.
#
# KEYS[1]  lock key
# KEYS[2]  fence counter (same hash slot as the lock key)
# ARGV[1]  token of the acquisition handing the fence out
# ARGV[2]  the fence, in decimal
# ARGV[3]  lifetime of the fence counter from its latest draw, in milliseconds
# Returns  1 when the counter now holds the fence or more and no other
#          acquisition of this name can have drawn that much here: it was
#          lower (or missing) and now holds the fence, or this token holds the
#          lock key here;
#          0 when the counter already held the fence or more and the lock key
#          is free here: some other draw, maybe of this name, reached it;
#          -1 when another token holds the lock key here (the counter is untouched).
#
# Only a 1 counts towards the majority the fence must be written to: a later
# acquisition then meets a counter that held the fence before it was handed
# out, so it draws a larger one. The counter is shared by every name, so it
# often passed the fence already by other names' draws. Where this token holds
# the lock key that is harmless: no acquisition of this name drew here since
# this one's own draw (it could not take the key), and every earlier one drew
# below it. Where the key is free, a draw of this name may have reached the
# fence, so that master does not count. A master where someone else holds the
# lock refuses, so the raise cannot land after a later holder drew its fence
# there. Counters only grow; like a draw, a raise renews the counter's expiry.
RAISE_FENCE = Script(
    "raise_fence",
    """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return -1
end
local current = redis.call('GET', KEYS[2])
if current and tonumber(current) >= tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  if holder then
    return 1
  end
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
""",
)
