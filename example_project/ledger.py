"""A tiny ledger that refuses writes from stale lock holders, using fencing tokens.

Each account is a hash holding its balance and the highest fence any accepted
write carried; accepted entries are appended to a list. A write that carries
a fence lower than the highest seen comes from a holder whose lock has since
passed to someone else (it paused, or its lock expired): the check and the
write happen in one Lua script, so nothing can slip in between.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis

# Apply a charge only if its fence is not older than the newest one seen.
#
# KEYS[1]  the account hash: fields "fence" (highest accepted fence) and "balance"
# KEYS[2]  the account's list of accepted entries
# ARGV[1]  the writer's fence (decimal integer)
# ARGV[2]  the amount (integer)
# ARGV[3]  the entry to append (JSON)
# Returns  {1, fence, balance} when applied; {0, highest fence seen, balance}
#          when refused. Fences go back as strings: they exceed 2^31.
#
# Equal fences are accepted: one holder may write several times under one lock.
RECORD_CHARGE = """
local highest = redis.call('HGET', KEYS[1], 'fence')
if highest and tonumber(ARGV[1]) < tonumber(highest) then
  return {0, highest, tonumber(redis.call('HGET', KEYS[1], 'balance') or '0')}
end
redis.call('HSET', KEYS[1], 'fence', ARGV[1])
local balance = redis.call('HINCRBY', KEYS[1], 'balance', ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[3])
return {1, ARGV[1], balance}
"""


@dataclass(frozen=True)
class WriteResult:
    """The ledger's answer to one write.

    Attributes:
        accepted: Whether the charge was applied.
        fence: The writer's fence if accepted, else the higher fence that refused it.
        balance: The account's balance after the call.
    """

    accepted: bool
    fence: int
    balance: int


def account_key(prefix: str, account_id: int) -> str:
    """The hash of one account; the braces keep its two keys in one Cluster slot."""
    return f"{prefix}:ledger:{{{account_id}}}"


def record_charge(
    client: redis.Redis, prefix: str, account_id: int, amount: int, *, fence: int, writer: str
) -> WriteResult:
    """Charge ``amount`` to ``account_id`` unless a write with a newer fence came first."""
    key = account_key(prefix, account_id)
    entry = json.dumps({"amount": amount, "fence": fence, "writer": writer})
    accepted, seen, balance = client.register_script(RECORD_CHARGE)(
        keys=[key, f"{key}:entries"], args=[fence, amount, entry]
    )
    return WriteResult(accepted=bool(accepted), fence=int(seen), balance=int(balance))


def balance(client: redis.Redis, prefix: str, account_id: int) -> int:
    """The account's balance (0 for an account never charged)."""
    return int(client.hget(account_key(prefix, account_id), "balance") or 0)
