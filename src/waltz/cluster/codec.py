"""Java ``DataOutput``/``DataInput`` style primitives for the values kept in ZooKeeper.

Every value under a cluster root is written the way the original Waltz wrote it with ``java.io.DataOutput``:
big-endian integers, and strings as ``writeUTF`` does (an unsigned 16-bit byte length, then *modified* UTF-8:
NUL is ``C0 80`` and characters outside the BMP are two 3-byte surrogates). For the ASCII ``host:port``
strings Waltz stores, modified UTF-8 is byte-for-byte plain UTF-8.

:class:`Writer` builds bytes; :class:`Reader` consumes them and raises :class:`~waltz.errors.MetadataError`
(never ``struct.error`` or ``IndexError``) on truncated or malformed input. :meth:`Reader.finish` rejects
trailing bytes so a value written by an incompatible version cannot be half-read silently.
"""

from __future__ import annotations

import struct
import uuid

from waltz.errors import MetadataError
from waltz.version import __version__

_I8 = struct.Struct(">b")
_U8 = struct.Struct(">B")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_U16 = struct.Struct(">H")

MAX_UTF_BYTES = 0xFFFF
"""``writeUTF`` cannot carry more than 65535 encoded bytes."""


def encode_modified_utf8(text: str) -> bytes:
    """Encode ``text`` as Java's modified UTF-8 (without the length prefix)."""
    out = bytearray()
    raw16 = text.encode("utf-16-be", "surrogatepass")
    for i in range(0, len(raw16), 2):
        unit = (raw16[i] << 8) | raw16[i + 1]
        if 0 < unit < 0x80:
            out.append(unit)
        elif unit < 0x800:
            out += bytes((0xC0 | (unit >> 6), 0x80 | (unit & 0x3F)))
        else:
            out += bytes((0xE0 | (unit >> 12), 0x80 | ((unit >> 6) & 0x3F), 0x80 | (unit & 0x3F)))
    return bytes(out)


def decode_modified_utf8(raw: bytes) -> str:
    """Decode Java's modified UTF-8; raises MetadataError on malformed input."""
    units = bytearray()
    i, n = 0, len(raw)
    while i < n:
        b = raw[i]
        if b < 0x80:
            if b == 0:
                raise MetadataError("malformed modified UTF-8: raw NUL byte")
            unit, i = b, i + 1
        elif b & 0xE0 == 0xC0 and i + 1 < n and raw[i + 1] & 0xC0 == 0x80:
            unit, i = ((b & 0x1F) << 6) | (raw[i + 1] & 0x3F), i + 2
        elif b & 0xF0 == 0xE0 and i + 2 < n and raw[i + 1] & 0xC0 == 0x80 and raw[i + 2] & 0xC0 == 0x80:
            unit, i = ((b & 0x0F) << 12) | ((raw[i + 1] & 0x3F) << 6) | (raw[i + 2] & 0x3F), i + 3
        else:
            raise MetadataError(f"malformed modified UTF-8 at byte {i}")
        units += unit.to_bytes(2, "big")
    try:
        return units.decode("utf-16-be")
    except UnicodeDecodeError:
        raise MetadataError("malformed modified UTF-8: unpaired surrogate") from None


class Writer:
    """Appends big-endian fields to a byte buffer."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def u8(self, value: int) -> Writer:
        self._buf += _U8.pack(value)
        return self

    def i32(self, value: int) -> Writer:
        self._buf += _I32.pack(value)
        return self

    def i64(self, value: int) -> Writer:
        self._buf += _I64.pack(value)
        return self

    def utf(self, text: str) -> Writer:
        raw = encode_modified_utf8(text)
        if len(raw) > MAX_UTF_BYTES:
            raise MetadataError(f"string too long for writeUTF ({len(raw)} bytes): {text[:40]!r}...")
        self._buf += _U16.pack(len(raw)) + raw
        return self

    def uuid(self, value: uuid.UUID) -> Writer:
        # java.util.UUID is written as two longs: most then least significant bits.
        self._buf += value.bytes
        return self

    def bytes(self) -> bytes:
        return bytes(self._buf)


class Reader:
    """Consumes big-endian fields; every failure is a :class:`MetadataError` naming ``what``."""

    def __init__(self, raw: bytes, what: str) -> None:
        self._raw = bytes(raw)
        self._pos = 0
        self._what = what

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._raw):
            raise MetadataError(f"{self._what}: truncated ({len(self._raw)} bytes)")
        chunk = self._raw[self._pos : end]
        self._pos = end
        return chunk

    def u8(self) -> int:
        return int(_U8.unpack(self._take(1))[0])

    def i8(self) -> int:
        return int(_I8.unpack(self._take(1))[0])

    def i32(self) -> int:
        return int(_I32.unpack(self._take(4))[0])

    def i64(self) -> int:
        return int(_I64.unpack(self._take(8))[0])

    def count(self, limit: int = 1 << 20) -> int:
        """An ``int`` element count, checked to be non-negative and plausible."""
        n = self.i32()
        if n < 0 or n > limit:
            raise MetadataError(f"{self._what}: bad element count {n}")
        return n

    def utf(self) -> str:
        (length,) = _U16.unpack(self._take(2))
        return decode_modified_utf8(self._take(length))

    def uuid(self) -> uuid.UUID:
        return uuid.UUID(bytes=self._take(16))

    def version(self, *expected: int) -> int:
        v = self.u8()
        if v not in expected:
            known = ", ".join(map(str, expected))
            raise MetadataError(
                f"{self._what}: format version {v}, but Waltz {__version__} reads version {known}: was it "
                "written by a newer release?"
            )
        return v

    def finish(self) -> None:
        if self._pos != len(self._raw):
            raise MetadataError(f"{self._what}: {len(self._raw) - self._pos} trailing bytes")
