"""Id counters: unique client and server ids, at ``<root>/ids/client`` and ``<root>/ids/server``.

Encoding (big-endian)::

    u8   format version   (1)
    i32  the last id handed out (0 at creation, so the first id is 1)

The original stored a bare int; a version byte was added here so every value under the root carries one.
An id is taken with a compare-and-set loop (read, increment, version-checked write), so two processes never
receive the same id.
"""

from __future__ import annotations

from waltz.cluster.codec import Reader, Writer

FORMAT_VERSION = 1


def encode_counter(value: int) -> bytes:
    return Writer().u8(FORMAT_VERSION).i32(value).bytes()


def decode_counter(raw: bytes) -> int:
    r = Reader(raw, "id counter")
    r.version(FORMAT_VERSION)
    value = r.i32()
    r.finish()
    return value
