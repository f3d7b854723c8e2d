"""Rate limits per key: an exact sliding window, checked and taken in one Lua call.

A rate key holds a log of start times (a sorted set: one member per admitted
call, scored by the server's clock in milliseconds). The script trims what the
window has left behind, admits a call only while fewer than ``limit`` starts lie
within the last ``window``, and otherwise answers with the exact milliseconds
until the oldest start that matters leaves the window. There is no fixed window,
so no burst of ``2 * limit`` at a boundary: every interval of ``window`` length
holds at most ``limit`` starts. A second key in the same hash slot holds a
"blocked until" time, set by :meth:`RateLimiter.back_off` (an upstream asked to
slow down); while it lies ahead, every call of the key is refused until then. A
third one records the rate the callers use (``"<limit> <window ms>"``), renewed
by admissions so that it outlives the log (by at most a window), so an
operator's view can tell ``used/limit`` without knowing the callers' options.

Times come from the Redis server (``TIME``), so workers on hosts with different
clocks share one.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .lua import Arg, Script

__all__ = [
    "BACK_OFF",
    "RATE_ACQUIRE",
    "RATE_REFUND",
    "RATE_USAGE",
    "Rate",
    "RateLimiter",
    "RateVerdict",
    "backoff_key",
    "new_member",
    "parse_rate",
    "rate_keys_of",
    "rate_spec_key",
    "verdict_of",
]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([smh])\s*$")


@dataclass(frozen=True)
class Rate:
    """At most ``limit`` starts in any ``window`` seconds.

    Attributes:
        limit: Starts allowed per window (at least 1).
        window: The window's length in seconds (at least 0.001).
        text: How the rate was written (``"100/m"``).
    """

    limit: int
    window: float
    text: str = ""

    @property
    def window_ms(self) -> int:
        """The window in milliseconds, as the script takes it."""
        return max(1, round(self.window * 1000))

    def __str__(self) -> str:
        return self.text or f"{self.limit}/{self.window:g}s"


def parse_rate(value: Any) -> Rate:
    """Read a rate: ``"100/m"``, ``"20/s"``, ``"5/h"``, or ``"N/Ts"`` (``"10/5s"``, ``"3/1.5m"``).

    Raises:
        ValueError: Saying what a rate looks like.
    """
    if isinstance(value, Rate):
        return value
    match = _RATE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError('must look like "100/m", "20/s", "5/h" or "10/5s" (count/window)')
    limit = int(match.group(1))
    window = float(match.group(2) or 1) * _UNITS[match.group(3)]
    if limit < 1:
        raise ValueError("must allow at least 1 call per window")
    if window < 0.001:
        raise ValueError("must have a window of at least 0.001 seconds")
    return Rate(limit, window, value.strip())


def backoff_key(key: str) -> str:
    """The key holding a rate key's "blocked until" time: same hash tag, same Cluster slot."""
    return f"{key}:backoff"


def rate_spec_key(key: str) -> str:
    """The key recording the rate a rate key's callers use (``"<limit> <window ms>"``)."""
    return f"{key}:spec"


@dataclass(frozen=True)
class RateVerdict:
    """The answer of one rate check.

    Attributes:
        admitted: Whether the call may start now (its start is logged).
        wait: Seconds until a slot frees (0 when admitted): the earliest time a
            retry can be admitted, whether a full window or a back-off is the cause.
        used: Starts within the window (counting this one when admitted).
        limit: Starts the window allows.
        at_ms: Server time of the admission in milliseconds (0 when refused).
        member: The call's entry in the log (for :meth:`RateLimiter.refund`).
        backed_off: The refusal is a back-off, not a full window.
    """

    admitted: bool
    wait: float
    used: int
    limit: int
    at_ms: int = 0
    member: str = ""
    backed_off: bool = False


def _rate_again(args: Sequence[Arg]) -> Sequence[Arg]:
    # The first send may have logged our member: let the resend find it.
    return (*args[:3], "1")


# Admit one call to a rate key's sliding window, or say how long until it can be.
#
# KEYS[1]  the window's log: sorted set, member -> start time (server ms)
# KEYS[2]  the back-off key: "blocked until" in server ms (same hash slot)
# KEYS[3]  the spec key: "<limit> <window ms>", for the operator's view (same slot);
#          rewritten (for two windows) only when it has less than a window left,
#          so it outlives the log, and a changed rate shows within a window
# ARGV[1]  limit: starts allowed per window
# ARGV[2]  window in milliseconds
# ARGV[3]  member: unique per call
# ARGV[4]  "0" on the first send; "1" on a resend after a lost reply: a member
#          already logged was admitted by the first send
# Returns  {1, start ms, used} when admitted; {0, wait ms, used} when the window
#          is full; {2, wait ms, used} while a back-off lasts.
RATE_ACQUIRE = Script(
    "rate_acquire",
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local used = redis.call('ZCARD', KEYS[1])
if ARGV[4] == '1' then
  local at = redis.call('ZSCORE', KEYS[1], ARGV[3])
  if at then
    return {1, tonumber(at), used}
  end
end
local blocked = tonumber(redis.call('GET', KEYS[2]) or '0')
if blocked > now then
  return {2, blocked - now, used}
end
if used < limit then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], window)
  if redis.call('PTTL', KEYS[3]) < window then
    redis.call('SET', KEYS[3], ARGV[1] .. ' ' .. ARGV[2], 'PX', 2 * window)
  end
  return {1, now, used + 1}
end
local oldest = redis.call('ZRANGE', KEYS[1], used - limit, used - limit, 'WITHSCORES')
return {0, tonumber(oldest[2]) + window - now, used}
""",
    resend=_rate_again,
)

# Take back a start that did not happen (the call's lock was refused after it
# was admitted), so the slot serves another call.
#
# KEYS[1]  the window's log
# ARGV[1]  the member to remove
# Returns  1 when it was logged, 0 otherwise. Safe to resend.
RATE_REFUND = Script("rate_refund", "return redis.call('ZREM', KEYS[1], ARGV[1])")

# Block every call of a rate key for a while (an upstream answered 429).
#
# KEYS[1]  the back-off key
# ARGV[1]  milliseconds from now
# Returns  the milliseconds until the block ends: never shortens a longer one.
# A resend sets the same block again from a slightly later now: harmless.
BACK_OFF = Script(
    "back_off",
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local wanted = now + tonumber(ARGV[1])
local blocked = tonumber(redis.call('GET', KEYS[1]) or '0')
if blocked >= wanted then
  return blocked - now
end
redis.call('SET', KEYS[1], string.format('%d', wanted), 'PX', ARGV[1])
return wanted - now
""",
)

# The read-only part of the scripts that show a rate key's use (here and in
# rate_inventory): given the locals now, limit and window, sets the locals
# used (starts in the window, KEYS[1]) and wait (ms until a slot frees, 0: one
# is free), and defines blocked (ms of back-off left, KEYS[2]).
READ_USE = """
used = redis.call('ZCOUNT', KEYS[1], '(' .. (now - window), '+inf')
if used >= limit then
  local oldest = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. (now - window), '+inf',
    'WITHSCORES', 'LIMIT', used - limit, 1)
  wait = tonumber(oldest[2]) + window - now
end
"""
READ_BLOCKED = """
local blocked = tonumber(redis.call('GET', KEYS[2]) or '0') - now
if blocked < 0 then
  blocked = 0
end
"""

# Read a rate key's use without changing it (the operator's view).
#
# KEYS[1]  the window's log;  KEYS[2]  the back-off key
# ARGV[1]  limit;  ARGV[2]  window in milliseconds
# Returns  {used, ms until a slot frees (0: one is free), ms of back-off left}
RATE_USAGE = Script(
    "rate_usage",
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local used, wait = 0, 0
"""
    + READ_USE
    + READ_BLOCKED
    + "return {used, wait, blocked}\n",
)


def rate_keys_of(key: str) -> tuple[str, str, str]:
    """The KEYS of :data:`RATE_ACQUIRE` for rate key ``key`` (one hash slot)."""
    return (key, backoff_key(key), rate_spec_key(key))


def new_member(call_id: str | None) -> str:
    """A call's entry in a rate key's log: its id (if any) and a random tail."""
    return f"{call_id or ''}:{secrets.token_hex(6)}"


def verdict_of(reply: Sequence[Any], rate: Rate, member: str) -> RateVerdict:
    """Read :data:`RATE_ACQUIRE`'s reply (shared by the asyncio limiter)."""
    status, value, used = (int(part) for part in reply)
    if status == 1:
        return RateVerdict(True, 0.0, used, rate.limit, at_ms=value, member=member)
    return RateVerdict(False, value / 1000, used, rate.limit, backed_off=status == 2)


class RateLimiter:
    """Admits calls to rate keys on one Redis (one server, Sentinel's master, or a Cluster).

    Args:
        client: A redis-py client.
        rate: The rate every key of this limiter allows.
    """

    def __init__(self, client: Any, rate: Rate) -> None:
        self.client = client
        self.rate = rate
        self.args = (rate.limit, rate.window_ms)

    def acquire(self, key: str, call_id: str | None = None) -> RateVerdict:
        """Admit a call to ``key`` now, or say how long until it can be: one round trip.

        Raises:
            redis.exceptions.RedisError: When the store fails.
        """
        member = new_member(call_id)
        reply = RATE_ACQUIRE(self.client, rate_keys_of(key), (*self.args, member, "0"))
        return verdict_of(reply, self.rate, member)

    def refund(self, key: str, verdict: RateVerdict) -> None:
        """Take back an admission whose call did not start (raises ``RedisError``)."""
        if verdict.admitted:
            RATE_REFUND(self.client, (key,), (verdict.member,))

    def back_off(self, key: str, seconds: float) -> float:
        """Refuse every call of ``key`` for ``seconds``; return how long the block lasts.

        A longer block already in place is kept.

        Raises:
            ValueError: If ``seconds`` is not positive.
            redis.exceptions.RedisError: When the store fails.
        """
        if not seconds > 0:
            raise ValueError(f"back_off needs a positive number of seconds, not {seconds!r}")
        ms = max(1, round(seconds * 1000))
        return int(BACK_OFF(self.client, (backoff_key(key),), (ms,))) / 1000

    def usage(self, key: str) -> tuple[int, float, float]:
        """``(used, seconds until a slot frees, seconds of back-off left)`` of ``key``."""
        used, wait, blocked = RATE_USAGE(self.client, (key, backoff_key(key)), self.args)
        return int(used), int(wait) / 1000, int(blocked) / 1000
