"""A lock's acquire and release, packed as the scripts pack them, from parts kept per lock.

Every task sends both. The packer (hiredis's ``pack_command``) converts each
argument and formats each length with ``sprintf``: a few thousand client
instructions per command. Here the parts that stay the same (the ``EVALSHA``
heads, and a lock's arguments after the token, its ``_acquire_tail``) are
packed once, and a call adds its key, fence counter and token with one bytes
format. The result is the same bytes (a unit test checks it); where it could
differ (no hiredis, so the connection's encoder encodes str; a bytes key; a
str token) these return ``None`` and the script packs the call itself.
"""

from __future__ import annotations

from .lua import PACKS_STR_AS_UTF8, bulk
from .scripts import ACQUIRE, RELEASE

__all__ = ["packed_acquire", "packed_release"]

# The acquire takes 2 keys and 4 arguments (6 items), the release 1 key and 2 (3).
_ACQUIRE_HEAD = ACQUIRE.head(2, 6)
_RELEASE_HEAD = RELEASE.head(1, 3)
# A release's first send (see scripts.RELEASE, ARGV[2]).
_FIRST_SEND = bulk(b"0")


def packed_acquire(name: object, fence_key: object, token: object, tail: bytes) -> bytes | None:
    """The first send of an acquire of ``name`` with ``token``; ``tail``: its packed last 3 args."""
    if not PACKS_STR_AS_UTF8 or type(name) is not str or type(fence_key) is not str:
        return None
    if type(token) is not bytes:
        return None
    key, counter = name.encode(), fence_key.encode()
    return b"%b$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n%b" % (
        _ACQUIRE_HEAD,
        len(key),
        key,
        len(counter),
        counter,
        len(token),
        token,
        tail,
    )


def packed_release(name: object, token: object) -> bytes | None:
    """The first send of a release of ``name`` held with ``token``."""
    if not PACKS_STR_AS_UTF8 or type(name) is not str or type(token) is not bytes:
        return None
    key = name.encode()
    return b"%b$%d\r\n%b\r\n$%d\r\n%b\r\n%b" % (
        _RELEASE_HEAD,
        len(key),
        key,
        len(token),
        token,
        _FIRST_SEND,
    )
