"""How a store error reads in log lines and messages: its class, its message and its cause.

redis-py 8 gives its errors a ``repr`` of only ``network:ConnectionError`` or
``server:ResponseError``, and a connection error's real reason (a refused
connection, a certificate that does not verify, a DNS failure) is often only in
the exception it was raised from. :func:`describe_error` says all of it on one
line, so an operator reading a log can tell an outage from a wrong CA file.
"""

from __future__ import annotations

__all__ = ["describe_error"]

#: How many causes are followed; a longer chain is cut with an ellipsis.
MAX_CAUSES = 4


def _own_text(exc: BaseException) -> str:
    """``ClassName: message``, or the class name alone when the message is empty."""
    name = type(exc).__name__
    # One line: a multi-line message (a Lua error, a Cluster dump) would split the log line.
    message = " ".join(str(exc).split())
    return f"{name}: {message}" if message else name


def _next_cause(exc: BaseException) -> BaseException | None:
    """The exception ``exc`` was raised from, else the one it was raised while handling."""
    if exc.__cause__ is not None:
        return exc.__cause__
    if exc.__suppress_context__:  # raise ... from None: the author chose to hide it
        return None
    return exc.__context__


def describe_error(exc: BaseException) -> str:
    """Describe ``exc`` on one line: ``ClassName: message (cause: ClassName: message)``.

    The chain of causes is followed through ``__cause__`` (``raise ... from``)
    and ``__context__`` (raised while handling another), up to
    :data:`MAX_CAUSES` deep. A cause whose message the outer one already
    repeats (redis-py copies the socket error's text into its own) is named by
    its class only.

    Example:
        ``ConnectionError: Error 1 connecting to db:6380. [SSL:
        CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed
        certificate (_ssl.c:1006). (cause: SSLCertVerificationError)``
    """
    causes: list[str] = []
    seen = {id(exc)}
    told = str(exc)
    cause = _next_cause(exc)
    while cause is not None and id(cause) not in seen:
        if len(causes) == MAX_CAUSES:
            causes.append("...")
            break
        seen.add(id(cause))
        message = str(cause)
        repeated = bool(message) and message in told
        causes.append(type(cause).__name__ if repeated else _own_text(cause))
        told += message
        cause = _next_cause(cause)
    text = ""
    for cause_text in reversed(causes):
        text = f" (cause: {cause_text}{text})"
    return _own_text(exc) + text
