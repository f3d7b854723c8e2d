"""Lua scripts of the lock, and the one way they are run.

Each script documents its KEYS, ARGV and return value. Scripts are sent with
``EVALSHA``; when the server does not know a script (after ``SCRIPT FLUSH`` or
a restart) it is sent once with ``EVAL``, which both runs and caches it, so a
flushed script costs one extra round trip, never a failed operation. After a
connection error a script is sent once more in the way it declares safe in
case the first send ran and only its reply was lost (see :class:`Script`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from redis.connection import BlockingConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

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
    "Script",
    "drop_connections",
]

Arg = Union[str, bytes, int, float]
#: How a script is sent again after a connection error: given the ARGV of the
#: first send, the ARGV of the resend, or ``None`` when it must not be resent.
Resend = Callable[[Sequence[Arg]], Optional[Sequence[Arg]]]


def _resend_as_is(args: Sequence[Arg]) -> Sequence[Arg]:
    """The resend of a script that does the same whether it ran once or twice."""
    return args


def _checkout(pool: Any) -> Any:
    # redis-py >= 5.3 takes no arguments (and warns about them); older versions
    # require the command name.
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("EVALSHA")


class _Reserved:
    """One connection per pool and process that the hot path keeps checked out.

    Checking a connection out of a redis-py pool and back in costs more client
    CPU than the script call itself (locks, a readiness poll, metrics), twice
    per task. A prefork child runs one task at a time, so one connection it
    keeps serves nearly every call; a call that finds it busy (another thread,
    the watchdog) uses the pool as before.

    A connection is only reserved from a pool that can spare one for good: one
    whose ``max_connections`` is at least :data:`RESERVE_FROM_POOLS_OF` and
    that is not a ``BlockingConnectionPool``. Any other pool is used per call: a
    connection kept out of a small pool is one that the application's own
    commands fail without (``MaxConnectionsError`` with ``max_connections=1``),
    and a blocking pool would make them wait for it.
    """

    __slots__ = ("busy", "connection")

    def __init__(self) -> None:
        self.busy = threading.Lock()
        self.connection: Any = None


#: Smallest ``max_connections`` of a pool that a connection is reserved from:
#: redis-py's default bound (100 in redis-py 8, ``2**31`` in older versions),
#: so default clients keep the fast path and a pool sized by hand to a few
#: connections keeps all of them for the application.
RESERVE_FROM_POOLS_OF = 100

_reserved: weakref.WeakKeyDictionary[Any, _Reserved] = weakref.WeakKeyDictionary()


def _spares_a_connection(pool: Any) -> bool:
    if isinstance(pool, BlockingConnectionPool):
        return False
    max_connections = getattr(pool, "max_connections", None)
    return isinstance(max_connections, int) and max_connections >= RESERVE_FROM_POOLS_OF


def _forget_reserved() -> None:
    # A forked child must not use its parent's sockets; redis-py resets the
    # pools themselves when the child first uses them.
    _reserved.clear()


os.register_at_fork(after_in_child=_forget_reserved)


def _reconnect_if_closed(connection: Any) -> None:
    try:
        # Readable before anything was sent: the server closed the connection
        # (end of file), or it owes a reply nobody read. Either way, start afresh.
        if connection.can_read():
            raise RedisConnectionError("connection not ready")
    except (RedisConnectionError, OSError):
        connection.disconnect()
        connection.connect()


class Script:
    """A Lua script identified by its SHA1, run with EVALSHA and an EVAL fallback.

    Unlike redis-py's ``Script`` it is not bound to a client and never issues
    ``SCRIPT EXISTS`` or ``SCRIPT LOAD``: the fast path is exactly one command.

    A connection error is met in two ways that look alike: the server closed
    an idle connection (the command never ran) or it ran the command and the
    reply was lost. The first is common and calls for sending the command
    again; the second makes a plain resend wrong for a script whose second run
    answers differently (a release finds its key gone) or does more (a renewal
    that adds time). So each script declares its ``resend``: given the ARGV of
    the first send, the ARGV to send again with, correct whichever way the
    first send went, or ``None`` when it must not be sent again (the
    ``ConnectionError`` is then raised).
    """

    __slots__ = ("check_connection", "name", "resend", "sha", "source")

    def __init__(
        self,
        name: str,
        source: str,
        resend: Resend = _resend_as_is,
        *,
        check_connection: bool = False,
    ) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()
        self.resend = resend
        #: Check the connection before sending, and reconnect if the server
        #: closed it (a restart): for a script whose resend, made although the
        #: first send surely did not run, would answer wrongly (a release would
        #: take a key lost with the dataset for one it deleted) or not be made
        #: at all (a renewal adding time). It costs a system call per call, so
        #: a script whose resend is right either way (an acquire) goes without.
        #: redis-py's pool makes this check on check-out, but not on a reserved
        #: connection, nor with maintenance notifications enabled (redis-py 8's
        #: default).
        self.check_connection = check_connection

    def __call__(
        self,
        client: Any,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        then: Sequence[Arg] | None = None,
    ) -> Any:
        """Run the script on ``client`` (a redis-py client) and return its reply.

        ``then`` is a command (``WAIT``) sent in the same write, right behind
        the script on the same connection; the reply is then the pair of both
        replies. It needs a client with a connection pool.

        Raises:
            redis.exceptions.RedisError: Whatever the server or connection raises,
                except ``NOSCRIPT``, which is handled here, and a connection
                error that the script's ``resend`` recovers from.
        """
        pool = getattr(client, "connection_pool", None)
        # A single-connection client owns its connection (client.connection);
        # Cluster clients have no pool: both go through redis-py.
        if pool is None or getattr(client, "connection", None) is not None:
            if then is not None:
                raise TypeError(f"{self!r}: a pipelined command needs a pooled client")
            try:
                return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
            except NoScriptError:
                return client.execute_command("EVAL", self.source, len(keys), *keys, *args)
        # The hot path of every task: talk to a pooled connection directly,
        # without redis-py's per-command bookkeeping (about a third of the
        # client's CPU per command).
        if _spares_a_connection(pool):
            reserved = _reserved.get(pool)
            if reserved is None:
                reserved = _reserved.setdefault(pool, _Reserved())
            if reserved.busy.acquire(blocking=False):
                try:
                    if reserved.connection is None:
                        reserved.connection = _checkout(pool)
                    return self._exchange(reserved.connection, keys, args, then)
                finally:
                    reserved.busy.release()
        connection = _checkout(pool)
        try:
            return self._exchange(connection, keys, args, then)
        finally:
            pool.release(connection)

    def _exchange(
        self, connection: Any, keys: Sequence[Arg], args: Sequence[Arg], then: Any = None
    ) -> Any:
        try:
            if self.check_connection:
                _reconnect_if_closed(connection)
            try:
                return self._run(connection, keys, args, then)
            except RedisConnectionError:
                # A connection the server closed (a restart, an idle timeout)
                # fails on first use, often only when the reply is read; like
                # redis-py, try once more on a fresh one, in the way the script
                # says is right if the first send did run. Timeouts are not
                # retried: the server may be hung.
                resent_args = self.resend(args)
                if resent_args is None:
                    raise
                connection.disconnect()
                # Explicitly: a Sentinel connection asks the Sentinels for the
                # current master in connect() only; the lazy connect of the next
                # send would return to the demoted one.
                connection.connect()
                return self._run(connection, keys, resent_args, then)
        except ResponseError:
            raise  # the server answered: the connection is in a clean state
        except BaseException:
            # Anything else may leave a reply unread on the socket: reconnect
            # before the connection is used again.
            connection.disconnect()
            raise

    def _run(
        self, connection: Any, keys: Sequence[Arg], args: Sequence[Arg], then: Any = None
    ) -> Any:
        if then is not None:
            return self._run_then(connection, keys, args, then)
        connection.send_command("EVALSHA", self.sha, len(keys), *keys, *args)
        try:
            return connection.read_response()
        except NoScriptError:
            connection.send_command("EVAL", self.source, len(keys), *keys, *args)
            return connection.read_response()

    def _run_then(
        self, connection: Any, keys: Sequence[Arg], args: Sequence[Arg], then: Sequence[Arg]
    ) -> tuple[Any, Any]:
        # One write, two replies. Both are read before an error is raised, so
        # the connection owes nothing afterwards.
        for command, script in (("EVALSHA", self.sha), ("EVAL", self.source)):
            packed = connection.pack_commands(
                [(command, script, len(keys), *keys, *args), tuple(then)]
            )
            connection.send_packed_command(packed)
            reply, after = _reply_or_error(connection), _reply_or_error(connection)
            if not isinstance(reply, NoScriptError):
                break
        for value in (reply, after):
            if isinstance(value, ResponseError):
                raise value
        return reply, after

    def send(self, client: Any, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run the script with ``EVAL``, source included, and return its reply.

        For a rare call that must take effect even if its reply is lost: an
        ``EVALSHA`` of a script the server has not cached yet answers
        ``NOSCRIPT`` and does nothing, and a caller that timed out never sends
        the ``EVAL`` fallback.
        """
        return client.execute_command("EVAL", self.source, len(keys), *keys, *args)

    def queue(self, pipeline: Any, keys: Sequence[Arg], args: Sequence[Arg]) -> None:
        """Queue the script on a pipeline; callers rerun NOSCRIPT replies with ``__call__``."""
        pipeline.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"<Script {self.name} {self.sha[:8]}>"


def _reply_or_error(connection: Any) -> Any:
    try:
        return connection.read_response()
    except ResponseError as exc:
        return exc


def drop_connections(client: Any) -> None:
    """Close ``client``'s idle connections, the one kept checked out included.

    Each reconnects on its next use: a Sentinel client then asks the Sentinels
    for the current master instead of writing on to the one it knew.
    """
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return
    reserved = _reserved.get(pool)
    if reserved is not None and reserved.busy.acquire(blocking=False):
        try:
            if reserved.connection is not None:
                reserved.connection.disconnect()
        finally:
            reserved.busy.release()
    pool.disconnect(inuse_connections=False)


def _acquire_again(args: Sequence[Arg]) -> Sequence[Arg]:
    # The first send may have taken the lock: let the resend find it ours.
    return (*args[:3], "1", *args[4:])


# Take the lock and draw a fence in one round trip.
#
# KEYS[1]  lock key
# KEYS[2]  fence key (same hash slot as the lock key)
# ARGV[1]  token
# ARGV[2]  ttl in milliseconds; "0" means the lock never expires
# ARGV[3]  lifetime of the fence key from its latest use, in milliseconds
# ARGV[4]  "0" on the first send; "1" when this same acquisition is sent again
#          after its reply was lost (see Script), so it may find ARGV[1] held
# ARGV[5]  (optional) "1": no fence below the server clock in microseconds
#          (replicated acquisition, see below)
# Returns  the fence (an integer > 0) when the lock was taken (or, with ARGV[4]
#          "1", already held with ARGV[1]), otherwise the table
#          {holder's PTTL in ms (-1: no expiry), holder's value}.
#
# Fences count up from a seed: the server clock in microseconds, taken when the
# fence key is missing (first use, a name unused for ARGV[3] ms, or a restart
# that lost it). The seed exceeds every fence handed out before, because no
# name is acquired a million times a second, so the fence key may expire and
# keys never pile up. Each draw renews the key's expiry, so a name in use never
# reseeds: in steady state the fence is a plain INCR, which keeps fences
# strictly increasing even if the server clock steps back.
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
# KEYS[2]  fence key (same hash slot as the lock key)
# ARGV[1]  token of the acquisition handing the fence out
# ARGV[2]  the fence, in decimal
# ARGV[3]  lifetime of the fence key from its latest use, in milliseconds
# Returns  1 when the counter was lower (or missing) and now holds the fence;
#          0 when it already held the fence or more: a value someone else drew;
#          -1 when another token holds the lock key here (the counter is untouched).
#
# Only a 1 counts towards the majority the fence must be written to: a later
# acquisition then meets a counter that this call raised before the fence was
# handed out, so it draws a larger one. A master where someone else holds the
# lock refuses, so the raise cannot land after a later holder drew its fence
# there. Counters only grow; like a draw, a raise renews the key's expiry.
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
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
""",
)

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
# KEYS[2]  fence key (same hash slot as the lock key)
# KEYS[3]  reservation key: the lock key itself (until_executed) or its
#          ":queued" sibling (until_and_while_executing, same hash slot)
# ARGV[1]  token of the execution lock
# ARGV[2]  ttl in milliseconds (> 0)
# ARGV[3]  lifetime of the fence key from its latest use, in milliseconds
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
local fence = redis.call('INCR', KEYS[2])
if fence == 1 then
  local now = redis.call('TIME')
  fence = tonumber(now[1]) * 1000000 + tonumber(now[2])
  redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', ARGV[3])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return {1, fence, found}
""",
)
