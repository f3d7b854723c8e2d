"""The semaphore's Lua scripts: take a permit, give it back, renew permits, leave the wait list.

A semaphore named ``name`` keeps its state in keys beside the name, all in the
name's Redis Cluster hash slot (:func:`semaphore_keys`), and draws its fences
from the store's counter of that slot, so every script below runs on one node:

``<name>:permits``
    Sorted set of the permits held. A member is ``<slot>|<fence>|<token>``:
    the permit's slot (0 to limit - 1, the lowest free one when taken), its
    fencing token, and the holder's token (for Celery, the holder value that
    names the task, worker and process). The score is the permit's expiry in
    milliseconds on the server's clock. An expired member is a free slot:
    every acquire removes expired members before it counts.
the fence counter (:func:`~celery_redlock.core.fences.fence_key_for`)
    The counter a :class:`~celery_redlock.Lock` of that name draws from too,
    so fences keep increasing when a name moves from one holder to N.
``<name>:waiters`` and ``<name>:waiting``
    The wait list of blocking acquires: one sorted set ordered by arrival (the
    server's clock in microseconds), one by when each entry lapses. A waiter
    renews its entry with every attempt; one that stops asking (it died) is
    dropped once its entry lapses.
``<name>:wake``
    A list a release pushes to when someone waits; blocking acquires wait on
    it with ``BLPOP`` between attempts instead of sleeping.

Each script documents its KEYS, ARGV and replies, and how it is sent again
after a connection error (see :class:`~celery_redlock.core.lua.Script`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .fences import fence_key_for
from .lock_options import key_beside
from .lua import Arg, Script

__all__ = [
    "ACQUIRE_PERMIT",
    "COUNT_PERMITS",
    "LEAVE_WAIT_LIST",
    "RELEASE_PERMIT",
    "RELEASE_PERMITS_HELD_BY",
    "RENEW_PERMITS",
    "SemaphoreKeys",
    "semaphore_keys",
]


class SemaphoreKeys:
    """The keys of one semaphore (see the module docstring), all in the name's hash slot.

    Attributes:
        permits: The sorted set of permits.
        fence: The fence counter.
        waiters: The wait list, by arrival.
        waiting: The wait list, by when each entry lapses.
        wake: The list blocking acquires wait on.
    """

    __slots__ = ("fence", "permits", "waiters", "waiting", "wake")

    def __init__(self, name: str, *, cluster: bool = False) -> None:
        self.permits = key_beside(name, "permits")
        self.fence = fence_key_for(name, cluster=cluster)
        self.waiters = key_beside(name, "waiters")
        self.waiting = key_beside(name, "waiting")
        self.wake = key_beside(name, "wake")


def semaphore_keys(name: str, *, cluster: bool = False) -> SemaphoreKeys:
    """Return the keys of the semaphore ``name`` (``cluster``: on a Redis Cluster client)."""
    return SemaphoreKeys(name, cluster=cluster)


def _acquire_again(args: Sequence[Arg]) -> Sequence[Arg]:
    # The first send may have taken the permit: let the resend find it ours.
    return (*args[:6], "1", *args[7:])


# Take a permit and draw its fence in one round trip, reclaiming expired permits first.
# (With no permit held the set does not exist: a new one gets the permit's TTL.)
#
# KEYS[1]  permits (sorted set; member "<slot>|<fence>|<token>", score = expiry in ms)
# KEYS[2]  fence counter (see fences.fence_key_for)
# KEYS[3]  waiters by arrival (score = server time in microseconds)
# KEYS[4]  waiters by when their entry lapses (score in ms)
# ARGV[1]  token
# ARGV[2]  ttl in milliseconds (> 0)
# ARGV[3]  limit: most permits held at once
# ARGV[4]  lifetime of the fence counter from its latest draw, in milliseconds
# ARGV[5]  owner: the task id field of the token (see holder.Holder.owner_field), or ""
# ARGV[6]  wait ms: "0" for a caller that does not wait; otherwise the caller
#          joins (or stays on) the wait list, its entry lapsing after this long
# ARGV[7]  "0" on the first send; "1" when the same acquisition is sent again
#          after its reply was lost (see Script), so it may find ARGV[1] held
# KEYS[5] and ARGV[8..10] (optional) a place in line (queue_scripts.Place):
#          waiters by presence; who waits (default ARGV[1]), its first arrival
#          in microseconds ("" or absent: now; an older one moves the entry
#          forward), and how long it counts as present (its entry lasts ARGV[6]).
#          Only the present waiters ahead of it then hold a free permit back.
# Returns  {1, fence, slot, member} when a permit was taken (or, with ARGV[7]
#          "1", already held with ARGV[1]); otherwise {0, PTTL in ms of the
#          permit reported (-1: none), that permit's token (nil: none), permits
#          held, waiters queued, the caller's rank in line (-1: not in line),
#          its arrival in microseconds (-1: none), the server clock in ms}.
#          The permit reported is one naming the same
#          owner (or token) when there is one, which refuses the call even if a
#          permit is free: a redelivered task must not run beside its first
#          delivery; otherwise the permit that expires first.
#
# Admission is first come, first served: while waiters are queued, a caller is
# admitted only if its place on the list (or, off the list, the list's length)
# is below the number of free permits, so a steady stream of new callers never
# overtakes a waiter. Fences are drawn as in scripts.ACQUIRE.
ACQUIRE_PERMIT = Script(
    "acquire_permit",
    """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ttl = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local entry = ARGV[1]
if ARGV[8] and ARGV[8] ~= '' then
  entry = ARGV[8]
end
local queued = redis.call('ZCARD', KEYS[3])
if queued > 0 then
  local lapsed = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
  for _, waiter in ipairs(lapsed) do
    redis.call('ZREM', KEYS[3], waiter)
    redis.call('ZREM', KEYS[4], waiter)
    if KEYS[5] then
      redis.call('ZREM', KEYS[5], waiter)
    end
  end
  queued = redis.call('ZCARD', KEYS[3])
end
local permits = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local used = {}
local held = 0
local first, first_at, own, own_at
for i = 1, #permits, 2 do
  local member, at = permits[i], tonumber(permits[i + 1])
  local slot, fence, token = string.match(member, '^(%d+)|(%d+)|(.*)$')
  if at <= now then
    -- Expired: its holder stopped renewing it (it died, or lost its way). Reclaimed.
    redis.call('ZREM', KEYS[1], member)
  elseif slot then
    held = held + 1
    used[tonumber(slot)] = true
    if token == ARGV[1] and ARGV[7] == '1' then
      -- This very acquisition ran before and its reply was lost: it is ours.
      redis.call('ZADD', KEYS[1], now + ttl, member)
      if redis.call('PTTL', KEYS[1]) < ttl then
        redis.call('PEXPIRE', KEYS[1], ttl)
      end
      return {1, tonumber(fence), tonumber(slot), member}
    end
    if token == ARGV[1] or (ARGV[5] ~= '' and
        string.match(token, '^v%d|[^|]*|([^|]*)|') == ARGV[5]) then
      own, own_at = token, at
    end
    if first_at == nil or at < first_at then
      first, first_at = token, at
    end
  end
end
local admitted = false
if own == nil and held < limit then
  if queued == 0 then
    admitted = true
  else
    local rank = redis.call('ZRANK', KEYS[3], entry)
    local ahead = rank or queued
    if KEYS[5] and ahead > 0 then
      -- In line as a call: only the waiters ahead that are present count.
      local present = 0
      for _, waiter in ipairs(redis.call('ZRANGE', KEYS[3], 0, ahead - 1)) do
        if tonumber(redis.call('ZSCORE', KEYS[5], waiter) or '0') > now then
          present = present + 1
          if present >= limit - held then
            break
          end
        end
      end
      ahead = present
    end
    admitted = ahead < limit - held
  end
end
if admitted then
  local slot = 0
  while used[slot] do
    slot = slot + 1
  end
  local fence = redis.call('INCR', KEYS[2])
  if fence == 1 then
    fence = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
    redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', ARGV[4])
  else
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
  end
  local member = string.format('%d|%d|', slot, fence) .. ARGV[1]
  redis.call('ZADD', KEYS[1], now + ttl, member)
  -- The set outlives its longest permit: a name nobody takes again leaves nothing.
  if held == 0 or redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  if queued > 0 then
    redis.call('ZREM', KEYS[3], entry)
    redis.call('ZREM', KEYS[4], entry)
    if KEYS[5] then
      redis.call('ZREM', KEYS[5], entry)
    end
  end
  return {1, fence, slot, member}
end
local wait = tonumber(ARGV[6])
local rank = -1
if wait > 0 and own == nil then
  local arrival = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  if ARGV[9] and ARGV[9] ~= '' then
    redis.call('ZADD', KEYS[3], 'LT', ARGV[9], entry)
  else
    redis.call('ZADD', KEYS[3], 'NX', arrival, entry)
  end
  rank = redis.call('ZRANK', KEYS[3], entry)
  redis.call('ZADD', KEYS[4], now + wait, entry)
  local last = 4
  if KEYS[5] then
    redis.call('ZADD', KEYS[5], now + tonumber(ARGV[10]), entry)
    last = 5
  end
  for k = 3, last do
    if redis.call('PTTL', KEYS[k]) < wait then
      redis.call('PEXPIRE', KEYS[k], wait)
    end
  end
  queued = redis.call('ZCARD', KEYS[3])
end
local reported, reported_at = first, first_at
if own ~= nil then
  reported, reported_at = own, own_at
end
local pttl = -1
if reported_at ~= nil then
  pttl = reported_at - now
end
local arrived = redis.call('ZSCORE', KEYS[3], entry) or -1
return {0, pttl, reported or false, held, queued, rank, arrived, now}
""",
    resend=_acquire_again,
)


def _release_again(args: Sequence[Arg]) -> Sequence[Arg]:
    # The first send most likely removed the permit: a missing permit is released.
    return (args[0], "1", *args[2:])


# Give a permit back: remove exactly that member, and wake a waiter if any.
#
# KEYS[1]  permits
# KEYS[2]  waiters by arrival
# KEYS[3]  wake list
# ARGV[1]  the permit's member ("<slot>|<fence>|<token>")
# ARGV[2]  "0" on the first send; "1" when the same release is sent again after
#          its reply was lost (see Script): a missing permit then counts as removed
# ARGV[3]  lifetime of the wake list in milliseconds
# ARGV[4]  most entries the wake list keeps (the limit)
# ARGV[5]  (optional) the most milliseconds the permit may have left to be
#          removed; "-1" or absent: any. The reaper's check that a permit's
#          renewals stopped: one renewed since it was read has more, and stays.
# Returns  1 when the permit was held and is now free (or, with ARGV[2] "1", is
#          missing), 0 when it was not held (expired and reclaimed, or released)
#          or has more than ARGV[5] left.
#
# A permit past its expiry that no acquire has reclaimed yet still counts as
# held: every acquire reclaims expired permits before it counts, so nobody was
# admitted in its place.
RELEASE_PERMIT = Script(
    "release_permit",
    """
local most = tonumber(ARGV[5] or '-1')
if most >= 0 then
  local at = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if at then
    local clock = redis.call('TIME')
    local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
    if tonumber(at) - now > most then
      return 0
    end
  end
end
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  if ARGV[2] == '1' then
    return 1
  end
  return 0
end
if redis.call('ZCARD', KEYS[2]) > 0 then
  redis.call('RPUSH', KEYS[3], '1')
  redis.call('LTRIM', KEYS[3], -tonumber(ARGV[4]), -1)
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
return 1
""",
    resend=_release_again,
    check_connection=True,
)


def _renew_again(args: Sequence[Arg]) -> Sequence[Arg] | None:
    # Setting an expiry twice sets it once; adding twice adds twice.
    return args if args[0] in ("1", b"1") else None


# Push back the expiry of any number of permits, each only while it is held.
# The same ARGV shape as scripts.RENEW, so the watchdog batches both alike.
#
# KEYS[i]      permits key of permit i
# ARGV[1]      "1": set each expiry to now + its milliseconds; "0": add them
# ARGV[2i]     member of permit i
# ARGV[2i+1]   milliseconds for permit i
# Returns      a table with, for each permit, the milliseconds it now has left,
#              or 0 when it is not held (an expired one is removed).
#
# After a lost reply (see Script) a call that sets expiries is sent again as it
# is; one that adds is not, and its caller gets the connection error.
RENEW_PERMITS = Script(
    "renew_permits",
    """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local replace = ARGV[1] == '1'
local result = {}
for i, key in ipairs(KEYS) do
  local member = ARGV[2 * i]
  local ms = tonumber(ARGV[2 * i + 1])
  result[i] = 0
  local at = redis.call('ZSCORE', key, member)
  if at then
    at = tonumber(at)
    if at <= now then
      redis.call('ZREM', key, member)
    else
      local expiry = now + ms
      if not replace then
        expiry = at + ms
      end
      redis.call('ZADD', key, expiry, member)
      if redis.call('PTTL', key) < expiry - now then
        redis.call('PEXPIRE', key, expiry - now)
      end
      result[i] = expiry - now
    end
  end
end
return result
""",
    resend=_renew_again,
    check_connection=True,
)

# Remove the permits whose holder value holds a fragment; for a worker cleaning up
# after a pool process it killed, which cannot release its own permit any more
# (the semaphore's twin of scripts.RELEASE_HELD_BY).
#
# KEYS[1]  permits
# KEYS[2]  waiters by arrival
# KEYS[3]  wake list
# ARGV[1]  the holder's fragment of the value (see holder.Holder.fragment)
# ARGV[2]  lifetime of the wake list in milliseconds
# Returns  how many permits were removed. Safe to send twice.
RELEASE_PERMITS_HELD_BY = Script(
    "release_permits_held_by",
    """
local removed = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.find(member, ARGV[1], 1, true) then
    removed = removed + redis.call('ZREM', KEYS[1], member)
  end
end
if removed > 0 and redis.call('ZCARD', KEYS[2]) > 0 then
  redis.call('RPUSH', KEYS[3], '1')
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
end
return removed
""",
)

# Leave the wait list: a blocking acquire that gave up.
#
# KEYS[1]  waiters by arrival
# KEYS[2]  waiters by when their entry lapses
# ARGV[1]  token
# Returns  1 when the token was on the list, 0 otherwise. Safe to send twice.
LEAVE_WAIT_LIST = Script(
    "leave_wait_list",
    """
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
""",
)

# Count the permits held now (expired ones are not).
#
# KEYS[1]  permits
# Returns  how many permits have not expired. Read-only; safe to send twice.
COUNT_PERMITS = Script(
    "count_permits",
    """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%d', now), '+inf')
""",
)
