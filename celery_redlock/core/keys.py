"""Lock keys: a task's name and arguments, canonicalised and hashed into a Redis key.

Two calls get the same key exactly when they would do the same work: positional
and keyword spellings of one call agree (arguments are bound to the task's
signature, defaults applied), tuples equal lists, and dates, times, UUIDs,
Decimals and bytes are encoded the way kombu's JSON serializer sends them, so a
key computed from the caller's objects equals the one computed in the worker
from the decoded message. Keys look like ``<prefix>:v1:{<task>:<sha256>}``: the
version lets a future format live beside this one, and the hash tag keeps the
lock key and the keys beside it (a semaphore's permits, a reservation) in one
Redis Cluster slot, the slot whose fence counter it draws from.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any, Union

from .exceptions import ConfigurationError, LockKeyError

__all__ = ["KEY_VERSION", "KeyBuilder", "KeySpec", "canonical_json"]

#: Bumped whenever the canonical form changes, so old and new keys never collide.
KEY_VERSION = "v1"

#: ``None`` (every argument), argument names, or ``(args, kwargs) -> str``.
KeySpec = Union[None, Sequence[str], Callable[[tuple[Any, ...], dict[str, Any]], str]]


def _tagged(kind: str, value: Any) -> dict[str, Any]:
    return {"__type__": kind, "__value__": value}


def _json_key(key: object) -> str:
    # The names JSON itself gives non-string keys, so {1: x} and the {"1": x}
    # the worker decodes from the message canonicalise alike.
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    raise TypeError(f"a dict key of type {type(key).__name__} has no JSON form")


# Types whose canonical form is the value itself (exactly these: see _canonical).
_AS_IS = frozenset({str, int, float, bool, type(None)})


def _canonical(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    if isinstance(value, Mapping):
        return {_json_key(key): _canonical(item) for key, item in value.items()}
    reducer = getattr(value, "__json__", None)
    if reducer is not None:
        return _canonical(reducer())
    if isinstance(value, datetime):  # before date: a datetime is a date
        return _tagged("datetime", value.isoformat())
    if isinstance(value, date):
        return _tagged("date", value.isoformat())
    if isinstance(value, time):
        return _tagged("time", value.isoformat())
    if isinstance(value, Decimal):
        return _tagged("decimal", str(value))
    if isinstance(value, uuid.UUID):
        return _tagged("uuid", {"hex": value.hex})
    if isinstance(value, bytes):
        try:
            return _tagged("bytes", value.decode("utf-8"))
        except UnicodeDecodeError:
            return _tagged("base64", base64.b64encode(value).decode("ascii"))
    raise TypeError(f"a value of type {type(value).__name__} has no canonical form")


def canonical_json(value: Any) -> str:
    """Return the canonical JSON text of ``value``.

    Raises:
        TypeError: If ``value`` holds something with no canonical form.
    """
    return _dumps(_canonical(value))


# One encoder for every key: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# JSONEncoder.encode builds its C encoder again on every call (a third of a
# key's Python): the same one, with _ENCODER's options, is built once here.
# Canonical values hold no cycles (_canonical would have recursed forever), so
# no markers. Without the C module, _ENCODER.encode does the same in Python.
_C_ENCODE: Callable[[Any, int], Sequence[str]] | None = (
    None
    if json.encoder.c_make_encoder is None  # type: ignore[attr-defined]
    else json.encoder.c_make_encoder(  # type: ignore[attr-defined]
        None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",", True, False, True
    )
)


def _dumps(canonical: Any) -> str:
    if _C_ENCODE is None or isinstance(canonical, str):
        return _ENCODER.encode(canonical)
    return "".join(_C_ENCODE(canonical, 0))


class KeyBuilder:
    """Computes the lock keys of one task.

    A name in ``spec`` is looked up among the task's parameters first (passed
    by position or keyword, defaults applied), then among the keyword
    arguments its ``**kwargs`` parameter collected. Such a name has no
    default: a call that does not pass it keys it as ``None``, the same as
    passing ``None``. A task with no readable signature counts as taking
    ``(*args, **kwargs)``.

    Args:
        task_name: The registered task name.
        run: The task's body, whose signature arguments are bound to.
        spec: Which arguments make the key (see :data:`KeySpec`).
        prefix: The key prefix (``redlock_key_prefix``).
        option: The option ``spec`` came from, as errors name it (``lock_key``).

    Raises:
        ConfigurationError: If ``spec`` names an argument ``run`` does not take.
    """

    def __init__(
        self,
        task_name: str,
        run: Callable[..., Any],
        spec: KeySpec,
        prefix: str,
        option: str = "lock_key",
    ) -> None:
        self.task_name = task_name
        self.spec = spec
        self.prefix = prefix
        try:
            self.signature: inspect.Signature | None = inspect.signature(run)
        except (TypeError, ValueError):  # builtins and some C callables
            self.signature = None
        # Where keyword arguments the signature does not name end up after
        # binding: its ``**`` parameter, or "kwargs" of the signature-less form
        # that ``_bind`` makes.
        self._extra_keywords: str | None = "kwargs"
        if self.signature is not None:
            self._extra_keywords = next(
                (p.name for p in self.signature.parameters.values() if p.kind is p.VAR_KEYWORD),
                None,
            )
        # Parameters that positional arguments alone fill, when every one of
        # them is a plain parameter without a default: such calls bind by zip.
        self._positional: tuple[str, ...] | None = None
        if self.signature is not None and all(
            p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
            for p in self.signature.parameters.values()
        ):
            self._positional = tuple(self.signature.parameters)
        if spec is not None and not callable(spec):
            names = [spec] if isinstance(spec, str) else list(spec)
            if self.signature is not None and self._extra_keywords is None:
                unknown = [n for n in names if n not in self.signature.parameters]
                if unknown:
                    raise ConfigurationError(
                        f"{task_name}.{option}",
                        spec,
                        f"names {unknown} that the task does not take "
                        f"(its arguments: {list(self.signature.parameters)})",
                    )
            self.spec = tuple(names)

    def key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """Return the lock key of a call with ``args`` and ``kwargs``.

        Raises:
            LockKeyError: If the arguments do not fit the task's signature, or
                one of them has no canonical form.
        """
        digest = hashlib.sha256(self.identity(args, kwargs).encode("utf-8")).hexdigest()
        return f"{self.prefix}:{KEY_VERSION}:{{{self.task_name}:{digest}}}"

    def identity(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """Return the canonical text that the key hashes: what makes two calls the same."""
        spec = self.spec
        if callable(spec):
            value = spec(tuple(args), dict(kwargs))
            if not isinstance(value, str):
                raise LockKeyError(
                    self.task_name, None, f"lock_key returned {value!r}, expected a str"
                )
            return value
        arguments = self._bind(args, kwargs)
        if spec is not None:
            arguments = {name: self._argument(arguments, name) for name in spec}
        parts = {}
        for name, value in arguments.items():
            if type(value) in _AS_IS:  # the common case, without a call
                parts[name] = value
                continue
            try:
                parts[name] = _canonical(value)
            except TypeError as exc:
                raise LockKeyError(
                    self.task_name,
                    name,
                    f"{exc}; choose the arguments that identify the work with "
                    "lock_key=[...] or give a callable",
                ) from None
        return _dumps(parts)

    def _argument(self, arguments: Mapping[str, Any], name: str) -> Any:
        # A parameter of the signature wins (binding gave it its value or its
        # default); any other name can only have come through ``**kwargs``,
        # where a name not passed has no default and reads as None.
        if name in arguments:
            return arguments[name]
        extra = arguments.get(self._extra_keywords, {}) if self._extra_keywords else {}
        return extra.get(name)

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if self.signature is None:
            return {"args": list(args), "kwargs": dict(kwargs)}
        names = self._positional
        if names is not None and not kwargs and len(args) == len(names):
            return dict(zip(names, args))
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise LockKeyError(
                self.task_name, None, f"arguments do not fit its signature: {exc}"
            ) from None
        bound.apply_defaults()
        return dict(bound.arguments)
