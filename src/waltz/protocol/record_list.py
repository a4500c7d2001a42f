"""Lists of records and of record headers as the storage protocols carry them, sans-I/O::

    i32 n · n x Record          (a record list)
    i32 n · n x RecordHeader    (a header list)

``Record`` and ``RecordHeader`` are laid out as in :mod:`waltz.protocol.records` (36 + data and 28 bytes).
Readers bound every count and length by the bytes that remain before they slice or allocate, and raise
:class:`~waltz.errors.RemoteProtocolError` otherwise; writers raise :class:`~waltz.errors.LocalProtocolError`
for a value a field cannot carry. They do not verify record checksums (see :mod:`waltz.protocol.storage`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Final, overload

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol.records import (
    HEADER_STRUCT,
    RECORD_HEADER_BYTES,
    RECORD_OVERHEAD_BYTES,
    RECORD_PREFIX,
    Record,
    RecordHeader,
    ReqId,
    make_record,
)
from waltz.protocol.wire import I32, I64, U32, Reader, Writer

__all__ = [
    "WireRecordList",
    "read_header_list",
    "read_record_list",
    "read_wire_record_list",
    "write_header_list",
    "write_record_list",
]

_MASK32: Final = 0xFFFFFFFF


def _check_count(n: int, what: str) -> None:
    if n > 0x7FFFFFFF:
        raise LocalProtocolError(f"too many {what}: {n}")


def write_record_list(w: Writer, records: Sequence[Record]) -> None:
    """Append ``i32 n · n x Record``. This is the hot path of replication: one struct call per record."""
    n = len(records)
    if n > 0x7FFFFFFF:  # (_check_count, inlined: once per batch)
        _check_count(n, "records")
    buf = w.buf
    buf += I32.pack(n)
    # (A tuple, the server's batches, is tested first: the ABC's isinstance is a Python call.)
    if type(records) is not tuple and isinstance(records, WireRecordList):
        # Already in wire form (a decoded list relayed as it is).
        buf += memoryview(records.buffer)[records.starts[0] : records.starts[-1]]
        return
    pack_prefix = RECORD_PREFIX.pack
    pack_u32 = U32.pack
    try:
        for txn, (msb, lsb), header, data, checksum in records:
            buf += pack_prefix(txn, msb, lsb, header, len(data))
            buf += data
            buf += pack_u32(checksum & _MASK32)
    except (struct.error, TypeError, ValueError) as e:
        raise LocalProtocolError(f"record cannot be encoded: {e}") from None


def read_record_list(r: Reader) -> tuple[Record, ...]:
    """Read ``i32 n · n x Record``, bounds-checking every length before slicing."""
    n = r.count(RECORD_OVERHEAD_BYTES)
    # Slices must be bytes (immutable, owned); one copy of a non-bytes buffer keeps the offsets valid.
    data = r.data if isinstance(r.data, bytes) else bytes(r.data)
    pos = r.pos
    end = r.end
    unpack_prefix = RECORD_PREFIX.unpack_from
    unpack_u32 = U32.unpack_from
    prefix_bytes = RECORD_PREFIX.size
    records: list[Record] = []
    append = records.append
    for _ in range(n):
        if pos + prefix_bytes > end:
            raise RemoteProtocolError(f"record list truncated at offset {pos}")
        txn, msb, lsb, header, size = unpack_prefix(data, pos)
        pos += prefix_bytes
        if size < 0 or pos + size + 4 > end:
            raise RemoteProtocolError(f"record data length {size} at offset {pos} does not fit the message")
        body = data[pos : pos + size]
        pos += size
        (checksum,) = unpack_u32(data, pos)
        pos += 4
        append(make_record(txn, msb, lsb, header, body, checksum))
    r.pos = pos
    return tuple(records)


class WireRecordList(Sequence[Record]):
    """A decoded ``i32 n · n x Record`` list kept in the bytes it arrived in (an AppendRequest's records).

    The storage node turns these bytes into its on-disk layout without building a Record per record (see
    ``waltz.storage.segment.append_wire_run``), which was the largest per-record cost of an append. The
    shape was checked when decoded (every length inside the message), so building a Record on access
    (indexing, iteration) cannot fail. It compares equal to any sequence of the same records.
    """

    __slots__ = ("_count", "_data", "_starts", "record_bytes")

    def __init__(self, data: bytes, starts: list[int], record_bytes: int = 0) -> None:
        self._data = data
        self._starts = starts
        self._count = len(starts) - 1
        self.record_bytes = record_bytes
        """The wire size shared by every record when the decoder found them all of one size (``starts`` is
        then ``range(starts[0], starts[-1] + 1, record_bytes)``), else 0: lets the storage node check and
        convert the list in bulk (``waltz.storage.segment.append_wire_run``)."""

    @property
    def first_transaction_id(self) -> int:
        """The id of the first record (the list must not be empty)."""
        return int(I64.unpack_from(self._data, self._starts[0])[0])

    @property
    def buffer(self) -> bytes:
        """The bytes the records lie in (the whole message payload)."""
        return self._data

    @property
    def starts(self) -> list[int]:
        """Offset in :attr:`buffer` of each record, then the end of the last: ``len(self) + 1`` values."""
        return self._starts

    @property
    def data_bytes(self) -> int:
        """Total length of the records' data."""
        return self._starts[-1] - self._starts[0] - RECORD_OVERHEAD_BYTES * self._count

    def __len__(self) -> int:
        return self._count

    def _record(self, i: int) -> Record:
        data = self._data
        start = self._starts[i]
        end = self._starts[i + 1] - 4
        txn, msb, lsb, header, _ = RECORD_PREFIX.unpack_from(data, start)
        return make_record(
            txn, msb, lsb, header, data[start + RECORD_PREFIX.size : end], U32.unpack_from(data, end)[0]
        )

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Record, ...]: ...

    def __getitem__(self, index: int | slice) -> Record | tuple[Record, ...]:
        n = len(self)
        if isinstance(index, slice):
            return tuple(self._record(i) for i in range(*index.indices(n)))
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("record index out of range")
        return self._record(index)

    def __iter__(self) -> Iterator[Record]:
        return (self._record(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WireRecordList | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"WireRecordList({tuple(self)!r})"


_UNIFORM_MIN_RECORDS = 4  # below this the per-record loop costs no more than the bulk check's set-up


def read_wire_record_list(r: Reader) -> WireRecordList:
    """Read ``i32 n · n x Record`` as a :class:`WireRecordList`, bounds-checking every length: one unpack per
    record, no copy."""
    n = r.count(RECORD_OVERHEAD_BYTES)
    data = r.data if isinstance(r.data, bytes) else bytes(r.data)
    pos = r.pos
    end = r.end
    unpack_size = I32.unpack_from
    size_at = RECORD_PREFIX.size - 4
    if n >= _UNIFORM_MIN_RECORDS:
        # Records of one size (what the server's batches of fixed-size payloads are): every length field is
        # checked with one slice per byte of it (byte j of every record's length, stepping a record at a
        # time) instead of one unpack per record.
        (size,) = unpack_size(data, pos + size_at)
        size_bytes = RECORD_OVERHEAD_BYTES + size
        stop = pos + size_bytes * n
        if size >= 0 and stop <= end:
            field = data[pos + size_at : pos + size_at + 4]
            if all(data[pos + size_at + j : stop : size_bytes] == field[j : j + 1] * n for j in range(4)):
                r.pos = stop
                return WireRecordList(data, list(range(pos, stop + 1, size_bytes)), size_bytes)
    starts = [0] * (n + 1)
    for i in range(n):
        starts[i] = pos
        if pos + RECORD_OVERHEAD_BYTES > end:
            raise RemoteProtocolError(f"record list truncated at offset {pos}")
        (size,) = unpack_size(data, pos + size_at)
        pos += RECORD_OVERHEAD_BYTES + size
        if size < 0 or pos > end:
            raise RemoteProtocolError(
                f"record data length {size} at offset {pos - size - 4} does not fit the message"
            )
    starts[n] = pos
    r.pos = pos
    return WireRecordList(data, starts)


def write_header_list(w: Writer, headers: Sequence[RecordHeader]) -> None:
    """Append ``i32 n · n x RecordHeader``."""
    _check_count(len(headers), "record headers")
    buf = w.buf
    buf += I32.pack(len(headers))
    pack = HEADER_STRUCT.pack
    try:
        for txn, (msb, lsb), header in headers:
            buf += pack(txn, msb, lsb, header)
    except (struct.error, TypeError, ValueError) as e:
        raise LocalProtocolError(f"record header cannot be encoded: {e}") from None


def read_header_list(r: Reader) -> tuple[RecordHeader, ...]:
    """Read ``i32 n · n x RecordHeader``, the count bounded by the bytes that remain."""
    n = r.count(RECORD_HEADER_BYTES)
    start = r._take(n * RECORD_HEADER_BYTES)
    view = memoryview(r.data)[start : start + n * RECORD_HEADER_BYTES]
    return tuple(
        RecordHeader(txn, ReqId(msb, lsb), header)
        for txn, msb, lsb, header in HEADER_STRUCT.iter_unpack(view)
    )
