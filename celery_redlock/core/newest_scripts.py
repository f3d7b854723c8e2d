"""Lua of the windows that keep the newest call: a generation per key, stamped and checked.

``debounce`` and ``until_and_while_executing`` with ``keep="latest"`` cannot
take back a message once it is published. Instead each call draws the next
generation of its key (:data:`STAMP`, at publish) and its message carries it;
when a message reaches a worker, :data:`CLAIM` runs it only if its generation
is still the newest, taking the execution lock in the same script. An older
message retires itself there, naming the copy that replaced it.

The generation lives in a hash next to the lock key (same hash slot):
``epoch`` (a random token drawn when the hash is created, so a message from
before the hash was lost is never mistaken for one after), ``gen`` (the newest
generation), ``task`` (the task id that carries it) and, for a debounce burst
still waiting, ``start`` (when the burst's first call came, in ms).
"""

from __future__ import annotations

from .lua import Script
from .window_scripts import DRAW_FENCE

__all__ = ["CLAIM", "STAMP", "UNSTAMP"]

# Publish side: draw the next generation, name the new copy, say when it may run.
#
# KEYS[1]  the generation hash
# ARGV[1]  the new copy's task id
# ARGV[2]  debounce quiet time in ms (0: none, the copy may run at once)
# ARGV[3]  debounce max wait in ms (0: none)
# ARGV[4]  ms the hash lasts beyond the copy's delay
# ARGV[5]  the epoch to give a hash that does not exist yet
# Returns  {generation, epoch, delay in ms, the task id it replaced ("" for none)}
# TTL      never shortened: an older copy due later (its countdown) must still
#          find the hash, or it would stand as the newest and run stale arguments.
# Resend   as is: a lost reply's generation goes unused, the next one is newer.
STAMP = Script(
    "newest_stamp",
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if not epoch then
  epoch = ARGV[5]
  redis.call('HSET', KEYS[1], 'epoch', epoch)
end
local replaced = redis.call('HGET', KEYS[1], 'task') or ''
local gen = redis.call('HINCRBY', KEYS[1], 'gen', 1)
redis.call('HSET', KEYS[1], 'task', ARGV[1])
local delay = 0
local quiet = tonumber(ARGV[2])
if quiet > 0 then
  local start = tonumber(redis.call('HGET', KEYS[1], 'start'))
  if not start then
    start = now
    redis.call('HSET', KEYS[1], 'start', string.format('%d', now))
  end
  local due = now + quiet
  local max_wait = tonumber(ARGV[3])
  if max_wait > 0 and due > start + max_wait then
    due = math.max(now, start + max_wait)
  end
  delay = due - now
end
local life = delay + tonumber(ARGV[4])
if redis.call('PTTL', KEYS[1]) < life then
  redis.call('PEXPIRE', KEYS[1], life)
end
return {gen, epoch, delay, replaced}
""",
)

# Publish side, after the broker refused the message STAMP was for: give the
# generation back, so the copy it replaced is the newest again.
#
# KEYS[1]  the generation hash
# ARGV[1]  the generation STAMP returned
# ARGV[2]  the task id it was drawn for
# ARGV[3]  the task id it replaced ("" for none)
# Returns  1 when given back; 0 when a newer call came meanwhile (it is newest).
UNSTAMP = Script(
    "newest_unstamp",
    """
local gen, task = unpack(redis.call('HMGET', KEYS[1], 'gen', 'task'))
if gen ~= ARGV[1] or task ~= ARGV[2] then
  return 0
end
if ARGV[3] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'gen', tonumber(gen) - 1, 'task', ARGV[3])
end
return 1
""",
)

# Worker side: run a copy only if it is still the newest, taking the execution
# lock (and drawing a fence, as ACQUIRE does) in the same step.
#
# KEYS[1]  lock key
# KEYS[2]  fence key (same hash slot)
# KEYS[3]  the generation hash (same hash slot)
# ARGV[1]  token of the execution lock
# ARGV[2]  ttl in milliseconds (> 0)
# ARGV[3]  lifetime of the fence key from its latest use, in milliseconds
# ARGV[4]  the message's generation ("" for a message without one: only the lock)
# ARGV[5]  the message's epoch
# ARGV[6]  the message's task id
# ARGV[7]  ms the hash lasts at least from now (never shortened, as in STAMP)
# Returns  {1, fence}: the newest, the lock is taken (a debounce burst ends here);
#          {0, holder's PTTL in ms, holder's value}: the newest, but a copy runs;
#          {2, task id}: superseded by that copy;
#          {3}: the hash was lost (a store restarted empty, or it expired): this
#          copy now stands as the newest of its epoch; it should wait one quiet
#          time, so that a newer copy of the same burst still in the queue can
#          take its place.
# Resend   as is: a second run finds its own token or its own generation.
CLAIM = Script(
    "newest_claim",
    """
local function keep(key, ms)
  if redis.call('PTTL', key) < tonumber(ms) then
    redis.call('PEXPIRE', key, ms)
  end
end
if ARGV[4] ~= '' then
  local epoch, gen, task = unpack(redis.call('HMGET', KEYS[3], 'epoch', 'gen', 'task'))
  local mine = tonumber(ARGV[4])
  if not epoch then
    redis.call('HSET', KEYS[3], 'epoch', ARGV[5], 'gen', ARGV[4], 'task', ARGV[6])
    keep(KEYS[3], ARGV[7])
    return {3}
  end
  if epoch ~= ARGV[5] or mine < tonumber(gen) then
    return {2, task}
  end
  if mine > tonumber(gen) then
    redis.call('HSET', KEYS[3], 'gen', ARGV[4], 'task', ARGV[6])
    keep(KEYS[3], ARGV[7])
    return {3}
  end
end
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] then
  return {0, redis.call('PTTL', KEYS[1]), current}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if ARGV[4] ~= '' then
  redis.call('HDEL', KEYS[3], 'start')
  keep(KEYS[3], ARGV[7])
end
"""
    + DRAW_FENCE
    + """return {1, fence}
""",
)
