"""Primitive encodings shared by every Waltz wire format (no I/O here).

All integers are big-endian two's complement, as Java's ``DataOutput`` writes them:

=========  ========================================================================
type       bytes
=========  ========================================================================
u8/byte    1
bool       1 (0 = false, 1 = true; any other value is a protocol error)
i16        2
i32        4
i64        8
bytes      i32 length, then that many bytes; length -1 encodes ``None``
string     UTF-8 encoded, then written as ``bytes`` (length -1 encodes ``None``)
int list   i32 count, then count x i32; count -1 encodes ``None``
uuid       two i64: the most significant half first
=========  ========================================================================

:class:`Reader` raises :class:`~waltz.errors.RemoteProtocolError` on any short read, bad length or bad
boolean, and :meth:`Reader.expect_end` on trailing bytes, so a decoder either returns a whole message or
raises that one error.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Sequence

from waltz.errors import LocalProtocolError, RemoteProtocolError

U8 = struct.Struct(">B")
I16 = struct.Struct(">h")
I32 = struct.Struct(">i")
U32 = struct.Struct(">I")
I64 = struct.Struct(">q")
U64 = struct.Struct(">Q")
TWO_U64 = struct.Struct(">QQ")

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


class Writer:
    """Appends primitive values to a growing buffer; :meth:`getvalue` returns the bytes."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def getvalue(self) -> bytes:
        return bytes(self.buf)

    def u8(self, value: int) -> Writer:
        try:
            self.buf += U8.pack(value)
        except struct.error:
            raise LocalProtocolError(f"byte out of range: {value}") from None
        return self

    def bool(self, value: bool) -> Writer:
        self.buf.append(1 if value else 0)
        return self

    def i16(self, value: int) -> Writer:
        try:
            self.buf += I16.pack(value)
        except struct.error:
            raise LocalProtocolError(f"short out of range: {value}") from None
        return self

    def i32(self, value: int) -> Writer:
        try:
            self.buf += I32.pack(value)
        except struct.error:
            raise LocalProtocolError(f"int out of range: {value}") from None
        return self

    def i64(self, value: int) -> Writer:
        try:
            self.buf += I64.pack(value)
        except struct.error:
            raise LocalProtocolError(f"long out of range: {value}") from None
        return self

    def bytes_(self, value: bytes | bytearray | memoryview | None) -> Writer:
        if value is None:
            self.buf += I32.pack(-1)
        else:
            if len(value) > I32_MAX:
                raise LocalProtocolError(f"byte array too long: {len(value)}")
            self.buf += I32.pack(len(value))
            self.buf += value
        return self

    def string(self, value: str | None) -> Writer:
        return self.bytes_(None if value is None else value.encode("utf-8"))

    def int_list(self, values: Sequence[int] | None) -> Writer:
        if values is None:
            self.buf += I32.pack(-1)
            return self
        self.buf += I32.pack(len(values))
        try:
            self.buf += struct.pack(f">{len(values)}i", *values)
        except struct.error:
            raise LocalProtocolError(f"int list value out of range: {values!r}") from None
        return self

    def uuid(self, value: uuid.UUID) -> Writer:
        self.buf += value.bytes
        return self

    def raw(self, data: bytes | bytearray | memoryview) -> Writer:
        self.buf += data
        return self


class Reader:
    """Reads primitive values from a buffer, raising RemoteProtocolError on anything malformed."""

    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes | bytearray | memoryview, pos: int = 0, end: int | None = None) -> None:
        self.data = data
        self.pos = pos
        self.end = len(data) if end is None else end

    def remaining(self) -> int:
        return self.end - self.pos

    def _take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.end:
            raise RemoteProtocolError(
                f"message truncated: need {n} bytes at offset {start}, have {self.end - start}"
            )
        self.pos = start + n
        return start

    def u8(self) -> int:
        return int(U8.unpack_from(self.data, self._take(1))[0])

    def bool(self) -> bool:
        value = self.data[self._take(1)]
        if value not in (0, 1):
            raise RemoteProtocolError(f"invalid boolean byte {value}")
        return value == 1

    def i16(self) -> int:
        return int(I16.unpack_from(self.data, self._take(2))[0])

    def i32(self) -> int:
        return int(I32.unpack_from(self.data, self._take(4))[0])

    def u32(self) -> int:
        return int(U32.unpack_from(self.data, self._take(4))[0])

    def i64(self) -> int:
        return int(I64.unpack_from(self.data, self._take(8))[0])

    def u64(self) -> int:
        return int(U64.unpack_from(self.data, self._take(8))[0])

    def bytes_(self) -> bytes | None:
        n = self.i32()
        if n == -1:
            return None
        if n < 0:
            raise RemoteProtocolError(f"negative byte array length {n}")
        start = self._take(n)
        return bytes(self.data[start : start + n])

    def bytes_required(self) -> bytes:
        start, end = self._required_span()
        return bytes(self.data[start:end])

    def bytes_view_required(self) -> bytes | memoryview:
        """:meth:`bytes_required` without the copy where that is safe: a read-only view of the bytes when the
        buffer is ``bytes`` (immutable, so the view can never change), a copy otherwise. For the megabytes of
        a range read's record run, which a copy would cost a memcpy into freshly faulted pages."""
        start, end = self._required_span()
        data = self.data
        return memoryview(data)[start:end] if type(data) is bytes else bytes(data[start:end])

    def _required_span(self) -> tuple[int, int]:
        """Where the next byte array (not null) is: ``(start, end)`` in :attr:`data`, consumed."""
        n = self.i32()
        if n < 0:
            raise RemoteProtocolError(
                "unexpected null byte array" if n == -1 else f"negative byte array length {n}"
            )
        start = self._take(n)
        return start, start + n

    def string(self) -> str | None:
        raw = self.bytes_()
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError("string is not valid UTF-8") from None

    def string_required(self) -> str:
        value = self.string()
        if value is None:
            raise RemoteProtocolError("unexpected null string")
        return value

    def int_list(self, max_count: int | None = None) -> list[int] | None:
        n = self.i32()
        if n == -1:
            return None
        if n < 0:
            raise RemoteProtocolError(f"negative list length {n}")
        if max_count is not None and n > max_count:
            raise RemoteProtocolError(f"list length {n} exceeds the limit {max_count}")
        start = self._take(4 * n)
        return list(struct.unpack_from(f">{n}i", self.data, start))

    def count(self, element_min_bytes: int) -> int:
        """Read an i32 element count, rejecting counts the remaining bytes cannot possibly hold."""
        # Not through i32() and remaining(): a storage node reads one count per append, and the two calls
        # cost more than the rest of this.
        n: int = I32.unpack_from(self.data, self._take(4))[0]
        if n < 0:
            raise RemoteProtocolError(f"negative element count {n}")
        if element_min_bytes > 0 and n * element_min_bytes > self.end - self.pos:
            raise RemoteProtocolError(f"element count {n} exceeds what the message can hold")
        return n

    def uuid(self) -> uuid.UUID:
        start = self._take(16)
        return uuid.UUID(bytes=bytes(self.data[start : start + 16]))

    def raw(self, n: int) -> bytes:
        start = self._take(n)
        return bytes(self.data[start : start + n])

    def expect_end(self) -> None:
        if self.pos != self.end:
            raise RemoteProtocolError(f"{self.end - self.pos} unexpected trailing bytes")
