"""Commands for Redlock's masters, in the wire format each master is sent.

A :class:`Request` is one command for one master: a script call (by SHA,
with its source where the master lacks it) or a plain command, and how to
send it again after a lost reply. A :class:`Template` packs a command that
is sent again and again with only the token changing, once per encoding.
Internal to :mod:`celery_redlock.core.redlock`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError

from .lua import Arg, Script
from .scripts import RELEASE

if TYPE_CHECKING:
    from .nodes import Node

__all__ = ["Encoding", "PackingKey", "Request", "Template"]

#: How one master encodes strings: (encoding, errors), as its connections do.
Encoding = tuple[str, str]
#: What a request's wire format depends on: the encoding, and whether a script
#: goes with its source (EVAL) or by its SHA (EVALSHA).
PackingKey = tuple[Encoding, bool]


def _bulk(arg: Arg, encoding: Encoding) -> bytes:
    """One argument as a RESP bulk string, encoded as redis-py's ``Encoder`` does."""
    if isinstance(arg, bytes):
        data = arg
    elif isinstance(arg, str):
        data = arg.encode(*encoding)
    elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
        data = repr(arg).encode()
    else:
        raise TypeError(f"cannot send {type(arg).__name__} {arg!r} to Redis")
    return b"$%d\r\n%s\r\n" % (len(data), data)


class Template:
    """A command sent again and again with one argument changing (the token), packed once.

    Packing a command argument by argument costs more client CPU than sending
    it; a lock sends the same acquire and release with a new token each time,
    so the bytes around the token are packed once per encoding.

    Args:
        command: The command; whatever is at ``slot`` is replaced by each value.
        slot: Where the changing argument goes (not the command name).
        script: The script the command runs (by ``EVALSHA`` or ``EVAL``), as
            for :class:`Request`.
    """

    __slots__ = ("_parts", "command", "script", "slot")

    def __init__(self, command: tuple[Arg, ...], slot: int, script: Script | None = None) -> None:
        if not 0 < slot < len(command):
            raise ValueError(f"slot {slot} is not an argument of {command!r}")
        self.command = command
        self.slot = slot
        self.script = script
        # PackingKey -> (bytes before the value, bytes after it)
        self._parts: dict[PackingKey, tuple[bytes, bytes]] = {}

    def request(self, value: bytes) -> Request:
        """The command with ``value`` at the slot."""
        slot = self.slot
        command = (*self.command[:slot], value, *self.command[slot + 1 :])
        return Request(command, self.script, self)

    def pack(self, key: PackingKey, value: bytes) -> bytes:
        """The command with ``value`` in its wire format for ``key``."""
        parts = self._parts.get(key) or self.parts(key)
        return b"%s$%d\r\n%s\r\n%s" % (parts[0], len(value), value, parts[1])

    def parts(self, key: PackingKey) -> tuple[bytes, bytes]:
        """The command's bytes before the value and after it, in the wire format for ``key``."""
        parts = self._parts.get(key)
        if parts is None:
            encoding, source = key
            command = _with_source(self.command, self.script) if source else self.command
            bulks = [_bulk(arg, encoding) for arg in command]
            # Computed again by a thread that races here: same bytes either way.
            parts = self._parts[key] = (
                b"*%d\r\n" % len(command) + b"".join(bulks[: self.slot]),
                b"".join(bulks[self.slot + 1 :]),
            )
        return parts


def _with_source(command: tuple[Arg, ...], script: Script | None) -> tuple[Arg, ...]:
    # EVALSHA <sha> ... -> EVAL <source> ...: every other argument keeps its place.
    if script is None:
        return command
    return ("EVAL", script.source, *command[2:])


class Request:
    """One command for one master: a script call (EVALSHA, EVAL on NOSCRIPT) or plain."""

    __slots__ = ("_packed", "behind", "command", "script", "template")

    def __init__(
        self,
        command: tuple[Arg, ...],
        script: Script | None = None,
        template: Template | None = None,
    ) -> None:
        self.command = command
        # The script the command runs, by EVALSHA (resent as EVAL on NOSCRIPT)
        # or EVAL; its ``resend`` says how to send it again after a lost reply.
        self.script = script
        # The template this request was made from, whose packed parts it reuses.
        self.template = template
        self._packed: dict[PackingKey, Any] = {}
        # A follow-up (the undo or release of a request that was late): on a
        # master reached through its client it goes behind its key's kept
        # connection, however long that has been kept (see through_client).
        self.behind = False

    def following(self) -> Request:
        """This request, as the follow-up of an earlier one for its key (see ``behind``)."""
        copy = Request(self.command, self.script, self.template)
        copy.behind = True
        return copy

    def packed(self, conn: Any, node: Node) -> Any:
        """Return the command in ``conn``'s wire format: packed once per round, not per master.

        A script goes with its source to a master that has not shown it knows
        the script: a NOSCRIPT that arrives after the vote is decided is never
        read, and the request would be dropped without anyone knowing.
        """
        source = self.script is not None and self.script.sha not in node.scripts
        key = (node.encoding, source)
        found = self._packed.get(key)
        if found is None:
            template = self.template
            if template is not None:
                value = self.command[template.slot]
                assert isinstance(value, bytes)
                found = [template.pack(key, value)]
            else:
                command = self.with_source() if source else self.command
                found = conn.pack_command(*command)
            self._packed[key] = found
        return found

    @property
    def may_wait(self) -> bool:
        """Whether it may wait for a busy master's job slot: a release, harmless whenever it runs.

        It deletes the key only where the key holds its token, and every
        attempt stores a value of its own (see ``Redlock._attempt_value``).
        """
        return self.script is RELEASE

    @classmethod
    def run(cls, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Request:
        """A script call by SHA, resent with its source where the master lacks it."""
        return cls(("EVALSHA", script.sha, len(keys), *keys, *args), script)

    @classmethod
    def release(cls, name: str, token: bytes) -> Request:
        """The compare-and-delete of ``token``, always sent with its source.

        A release must run even when nobody reads its reply (a master that
        answers after the vote was decided), and an unread NOSCRIPT would drop
        it silently. The script is short, so EVAL costs next to nothing more.
        """
        return cls(("EVAL", RELEASE.source, 1, name, token, "0"), RELEASE)

    def resent(self) -> Request | None:
        """The request to send again after a connection error, or ``None`` if it must not be.

        The first send may have run and only its reply been lost, so a script
        goes again as its ``resend`` says (see :class:`~celery_redlock.core.lua.Script`);
        any other command goes again as it is.
        """
        script = self.script
        if script is None:
            return self
        first_arg = 3 + int(self.command[2])
        args = self.command[first_arg:]
        again = script.resend(args)
        if again is None:
            return None
        if again is args:
            return self
        return Request((*self.command[:first_arg], *again), script)

    @property
    def key(self) -> Arg | None:
        """The first key the command names (the lock's), or ``None``."""
        command = self.command
        if command[0] in ("EVAL", "EVALSHA"):
            return command[3] if len(command) > 3 and int(command[2]) > 0 else None
        return command[1] if len(command) > 1 else None

    def with_source(self) -> tuple[Arg, ...]:
        """Return the command as EVAL.

        For a master that lost its script cache, or a request nobody will read
        the answer of (so a NOSCRIPT would go unseen).
        """
        return _with_source(self.command, self.script)

    def call(self, client: Any) -> Any:
        """Run the request through a redis-py client (for masters that cannot be polled)."""
        try:
            return client.execute_command(*self.command)
        except NoScriptError:
            return client.execute_command(*self.with_source())
