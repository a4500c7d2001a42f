"""Partition-local optimistic locks and the 32-bit value the wire carries for each.

A lock is an application-chosen ``(name, id)`` pair whose scope is one partition. The server never sees the
pair, only a 32-bit hash of it, which must be bit-for-bit the value the original Java client computes so that
Python and Java clients writing to the same partition lock the same slots of the server's lock table::

    lock_hash(lock) = String.hashCode(name) XOR Long.hashCode(id)

    String.hashCode(s) = s[0]*31^(n-1) + s[1]*31^(n-2) + ... + s[n-1]   (int arithmetic, wrapping at 2^32)
        where s[i] are the UTF-16 code units of s (a character outside the BMP counts as its two surrogates)
    Long.hashCode(x)   = (int)(x ^ (x >>> 32))                           (x a signed 64-bit long)

The result is a signed 32-bit int, as the ``int[]`` lock arrays of an AppendRequest carry it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from waltz.protocol.records import to_signed32
from waltz.protocol.wire import I64_MAX, I64_MIN

__all__ = ["PartitionLocalLock", "java_long_hash", "java_string_hash", "lock_hash", "lock_hashes"]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


@lru_cache(maxsize=4096)
def java_string_hash(text: str) -> int:
    """``text.hashCode()`` as Java computes it: over UTF-16 code units, with 32-bit overflow (signed result).

    Cached because applications use few lock names with many ids.
    """
    h = 0
    if text.isascii():
        # ASCII characters are exactly one UTF-16 code unit each.
        for ch in text:
            h = (31 * h + ord(ch)) & _MASK32
    else:
        units = text.encode("utf-16-be", "surrogatepass")
        for unit in struct.unpack(f">{len(units) // 2}H", units):
            h = (31 * h + unit) & _MASK32
    return to_signed32(h)


def java_long_hash(value: int) -> int:
    """``Long.hashCode(value)``: the xor of the two 32-bit halves of its 64-bit two's complement (signed)."""
    bits = value & _MASK64
    return to_signed32(bits ^ (bits >> 32))


@dataclass(frozen=True, slots=True, init=False)
class PartitionLocalLock:
    """An optimistic lock: an application-defined ``name`` and ``id`` (a Java long), scoped to one partition.

    Frozen and hashable, so locks can be collected in sets. Two locks with equal ``lock_hash`` values are the
    same lock as far as the server is concerned (a collision can cause false lock failures, never missed
    ones).
    """

    name: str
    id: int

    def __init__(self, name: str, id: int) -> None:
        # Written out instead of the generated __init__ + __post_init__ (one lock per locked append, often
        # made in execute): one call less, and the slots set through their descriptors rather than the
        # frozen class's object.__setattr__ detour.
        if not I64_MIN <= id <= I64_MAX:
            raise ValueError(f"lock id {id} does not fit in a signed 64-bit long")
        _set_name(self, name)
        _set_id(self, id)

    def hash32(self) -> int:
        """The 32-bit value carried on the wire for this lock (see :func:`lock_hash`)."""
        return java_string_hash(self.name) ^ java_long_hash(self.id)


# The slot descriptors of the (frozen) fields, for __init__.
_set_name: Any = PartitionLocalLock.__dict__["name"].__set__
_set_id: Any = PartitionLocalLock.__dict__["id"].__set__


def lock_hash(lock: PartitionLocalLock) -> int:
    """``name.hashCode() ^ Long.hashCode(id)``, the signed 32-bit value the Java client sends for ``lock``."""
    # The xor of two signed 32-bit ints is again a signed 32-bit int, so no re-normalisation is needed.
    # java_long_hash inlined (one per write lock per append): two Python calls less.
    lock_id = lock.id
    if 0 <= lock_id <= 0x7FFFFFFF:
        return java_string_hash(lock.name) ^ lock_id  # Long.hashCode of a small id is the id itself.
    bits = lock_id & _MASK64
    h = (bits ^ (bits >> 32)) & _MASK32
    return java_string_hash(lock.name) ^ (h - (1 << 32) if h >= 1 << 31 else h)


def lock_hashes(locks: Iterable[PartitionLocalLock]) -> tuple[int, ...]:
    """The wire values of ``locks``, in order; a repeated lock costs nothing extra on the server."""
    return tuple(java_string_hash(lock.name) ^ java_long_hash(lock.id) for lock in locks)
