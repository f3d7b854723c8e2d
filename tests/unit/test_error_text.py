"""describe_error: a store error on one line with its class, its message and its causes."""

from __future__ import annotations

import ssl

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError

from celery_redlock.core.error_text import MAX_CAUSES, describe_error


def raised(make_error):
    """The exception ``make_error()`` raises, with the chain Python gives it."""
    try:
        make_error()
    except BaseException as exc:  # whatever was built
        return exc
    raise AssertionError("nothing raised")


def test_redis_py_errors_read_better_than_their_repr():
    """redis-py 8's repr is "server:NoPermissionError"; the description has the message."""
    error = NoPermissionError("No permissions to access a key")
    assert "No permissions" not in repr(error)
    assert describe_error(error) == "NoPermissionError: No permissions to access a key"


def test_a_cause_the_message_does_not_repeat_is_shown_in_full():
    """``raise ... from`` adds the cause's class and message."""

    def refuse():
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as exc:
            raise RedisConnectionError("Error connecting to db:6379") from exc

    assert describe_error(raised(refuse)) == (
        "ConnectionError: Error connecting to db:6379 "
        "(cause: ConnectionRefusedError: [Errno 111] Connection refused)"
    )


def test_a_cause_the_message_repeats_is_named_by_its_class():
    """redis-py copies the SSL error's text into its own: the cause adds only its class."""
    reason = "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate"

    def verify():
        try:
            raise ssl.SSLCertVerificationError(1, reason)
        except ssl.SSLError as exc:
            # As redis-py does: raised while handling, so the SSL error is the context.
            raise RedisConnectionError(f"Error 1 connecting to db:6380. {exc}.") from None

    def verify_with_context():
        try:
            raise ssl.SSLCertVerificationError(1, reason)
        except ssl.SSLError as exc:
            raise RedisConnectionError(f"Error 1 connecting to db:6380. {exc}.")  # noqa: B904

    hidden = describe_error(raised(verify))
    assert hidden == f"ConnectionError: Error 1 connecting to db:6380. {reason}."
    shown = describe_error(raised(verify_with_context))
    assert shown == f"{hidden} (cause: SSLCertVerificationError)"


def test_causes_nest_and_a_long_chain_is_cut():
    """Each cause nests in the previous one's parentheses, up to MAX_CAUSES deep."""

    def chain(depth):
        if depth == 0:
            raise KeyError("root")
        try:
            chain(depth - 1)
        except Exception as exc:
            raise RuntimeError(f"level {depth}") from exc

    two = describe_error(raised(lambda: chain(2)))
    assert two == "RuntimeError: level 2 (cause: RuntimeError: level 1 (cause: KeyError: 'root'))"
    deep = describe_error(raised(lambda: chain(MAX_CAUSES + 3)))
    assert deep.count("(cause: ") == MAX_CAUSES + 1
    assert deep.endswith("(cause: ...)" + ")" * MAX_CAUSES)


@pytest.mark.parametrize("message", ["", "line one\n  line two"])
def test_the_description_is_one_line(message):
    """An empty message leaves the class name; a multi-line one is joined into one line."""
    text = describe_error(ValueError(message))
    assert "\n" not in text
    assert text == ("ValueError" if not message else "ValueError: line one line two")


def test_a_cycle_in_the_chain_ends_the_description():
    """An exception that is its own context's context does not loop."""
    first, second = ValueError("a"), ValueError("b")
    first.__context__, second.__context__ = second, first
    assert describe_error(first) == "ValueError: a (cause: ValueError: b)"
