"""Record runs: consecutive transaction records exactly as a storage node stores them, for bulk reads.

A run of ``n`` records starting at transaction ``first`` is ``n`` stored records back to back, each
``40 + len`` bytes, the layout of a segment data file (:mod:`waltz.storage.segment`; big-endian)::

    offset  size  field
         0     8  i64 transaction id (first, first + 1, ... in order)
         8    16  ReqId (u64 msb · u64 lsb)
        24     4  i32 application header
        28     4  i32 len, the data length (>= 0)
        32     4  u32 data checksum: the CRC-32 of the data computed by the client that built the transaction
        36   len  data
    36+len     4  u32 record checksum: CRC-32 of bytes 0 .. 36+len-1 of this record

Range reads (storage ``RecordRunRequest``, client-server V5 ``TransactionRangeResponse``) carry runs so that
nothing between the disk and the reader touches individual records beyond the storage node's check of each
record's id and record checksum right after its ``pread`` (so a damaged replica is found and another one
read): the storage node sends the bytes of its data file as they are, the server checks only that the run
can hold the records announced and starts at the id asked for, and forwards it untouched, and the reader
checks the shape and both checksums of every record while unpacking (:func:`run_records`, :func:`run_columns`,
or :func:`run_bounds` for a reader that cuts the fields out itself, as the Spark source does with Arrow). So
the checks are end to end: corruption on disk, in a cache, in memory or on the wire is caught where the data
is used, and the per-record work happens in the reader, which scales with the number of readers, not in the
one server that owns the partition.

Every function here is pure (no I/O). Unpacking raises :class:`~waltz.errors.RemoteProtocolError` for a run
whose shape is wrong (an id out of sequence, a length that runs past the end, bytes left over, more records
than announced) and :class:`~waltz.errors.DataChecksumError` for a record whose checksum does not verify;
nothing is returned from a run that does not verify whole.
"""

from __future__ import annotations

import functools
import itertools
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from waltz.errors import DataChecksumError, LocalProtocolError, RemoteProtocolError
from waltz.protocol.checksum import crc32
from waltz.protocol.records import Record, make_record

__all__ = [
    "STORED_HEADER_BYTES",
    "STORED_OVERHEAD_BYTES",
    "RecordRun",
    "RunBytes",
    "RunColumns",
    "encode_run",
    "run_bounds",
    "run_columns",
    "run_first_id",
    "run_records",
    "scan_run",
    "stored_size",
    "uniform_run_verifies",
]

STORED_PREFIX = struct.Struct(">qQQiiI")  # id, ReqId msb, ReqId lsb, header, len, data checksum
STORED_HEADER_BYTES = STORED_PREFIX.size  # 36
STORED_OVERHEAD_BYTES = STORED_HEADER_BYTES + 4  # 40
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_I32_MAX = 2**31 - 1


RunBytes = bytes | memoryview
"""A received run: decoders hand out a read-only view of the frame's payload (immutable bytes) rather than a
copy of its megabytes (``Reader.bytes_view_required``); runs built locally are bytes."""


def stored_size(record: Record) -> int:
    """Bytes ``record`` takes in a run."""
    return STORED_OVERHEAD_BYTES + len(record.data)


def encode_run(records: Iterable[Record]) -> bytes:
    """The run of ``records`` (in the order given; the caller keeps the ids consecutive)."""
    out = bytearray()
    for rec in records:
        if len(rec.data) > _I32_MAX:
            raise LocalProtocolError(f"record data too long: {len(rec.data)}")
        try:
            head = STORED_PREFIX.pack(
                rec.transaction_id, rec.req_id.msb, rec.req_id.lsb, rec.header, len(rec.data), rec.checksum
            )
        except struct.error:
            raise LocalProtocolError(
                f"record field out of range: {rec.transaction_id}, {rec.header}"
            ) from None
        start = len(out)
        out += head
        out += rec.data
        out += _U32.pack(crc32(memoryview(out)[start:]))
    return bytes(out)


def run_first_id(run: bytes | bytearray | memoryview) -> int:
    """The id of a run's first record (the run must hold at least its header)."""
    if len(run) < STORED_OVERHEAD_BYTES:
        raise RemoteProtocolError(f"a run of {len(run)} bytes holds no record")
    return int(_I64.unpack_from(run, 0)[0])


_ID_AND_LENGTH = struct.Struct(">q20xi")  # what a shape check needs of a record's header


def scan_run(run: bytes | bytearray | memoryview, first: int, count: int) -> None:
    """Check the shape of a run said to hold ``count`` records from ``first``: ids in sequence, every length
    inside the run, nothing left over. Checksums are not checked (the reader does). Costs one two-field
    unpack per record; used where runs are relayed, not consumed."""
    size = len(run)
    if count < 0 or count * STORED_OVERHEAD_BYTES > size:
        raise RemoteProtocolError(f"a run of {size} bytes cannot hold {count} records")
    unpack = _ID_AND_LENGTH.unpack_from
    pos = 0
    last = count - 1
    for i in range(count):
        txn, n = unpack(run, pos)
        if txn != first + i:
            raise RemoteProtocolError(f"run record {i}: transaction {txn}, expected {first + i}")
        pos += STORED_OVERHEAD_BYTES + n
        if n < 0 or pos > size:
            raise RemoteProtocolError(f"run record {i} (transaction {txn}): bad length {n}")
        if i < last and pos + STORED_OVERHEAD_BYTES > size:
            raise RemoteProtocolError(f"run ends after {i + 1} of {count} records")
    if pos != size:
        raise RemoteProtocolError(f"{size - pos} bytes left over after {count} run records")


@dataclass(frozen=True, slots=True)
class RecordRun:
    """``count`` consecutive records from ``first`` as a run, as received: its shape and checksums are checked
    when it is unpacked (:meth:`records`, :meth:`columns`, :func:`run_bounds`), which refuses the whole run
    if any of it is wrong."""

    first: int
    count: int
    run: RunBytes

    @property
    def end(self) -> int:
        """The id after the last record."""
        return self.first + self.count

    def records(self) -> list[Record]:
        return run_records(self.run, self.first, self.count)

    def columns(self, *, include_data: bool = True) -> RunColumns:
        return run_columns(self.run, self.first, self.count, include_data=include_data)


class RunColumns(NamedTuple):
    """A verified run unpacked column-wise, ready for columnar consumers (Arrow).

    Record ``i`` has id ``first + i``, header ``headers[i]``, request id ``req_ids[16*i : 16*i+16]`` (msb then
    lsb, big-endian) and data ``data[data_offsets[i] : data_offsets[i+1]]`` (empty ``data`` and offsets when
    the data was not asked for).
    """

    first: int
    num_records: int
    headers: list[int]
    req_ids: bytes
    data: bytes
    data_offsets: list[int]


def _check_record(
    run: bytes | bytearray | memoryview, view: memoryview, pos: int, end: int, txn: int, data_crc: int
) -> None:
    stored = _U32.unpack_from(run, end)[0]
    if crc32(view[pos:end]) != stored:
        raise DataChecksumError(f"transaction {txn}: record checksum mismatch")
    if crc32(view[pos + STORED_HEADER_BYTES : end]) != data_crc:
        raise DataChecksumError(f"transaction {txn}: data does not match its checksum")


_PREFIX_CHECKED = struct.Struct(">q20xiI")  # id, len, data checksum: what verifying a record needs

# Runs of records of one size (fixed-size payloads, as many applications and every benchmark write) are
# verified with a constant number of calls into C instead of a Python loop over the records. The checks
# are those of the loop; what makes it possible is that the CRC-32 is linear over GF(2):
#
# * zlib's CRC-32 of a message followed by its own CRC in little-endian order is the same constant for
#   every message (the "residue"). A record ends with its checksum in big-endian order, so the check
#   copies the run and reverses the 4 checksum bytes of every record (extended-slice assignments, one per
#   byte lane, done in C). In the copy, every record that verifies has that residue.
# * crc32(A + B) depends only on crc32(A), crc32(B) and len(B). So the CRC-32 of the whole copy equals the
#   CRC-32 of any run of verifying records of the same sizes, for instance all-zero ones (computed once per
#   size and count, cached). One damaged record changes the CRC-32 of the whole copy as it changes its
#   own (the shift by the bytes after it is invertible), so it is always caught; damage in several records
#   cancels only as rarely as a CRC-32 collision (2**-32 for random damage). A run that does not verify
#   is then checked by the loop, which names the record.
# * The data checksum is checked the same way on a second copy in which each record's 36-byte header is
#   zeroed and its data checksum moved, little-endian, to the end of the record.
_FAST_MIN_RECORDS = 16
_CANONICAL_BLOCK_RECORDS = 256


_SCRATCH_MAX_BYTES = 16 * 1024 * 1024
_scratch = threading.local()


def _scratch_copy(run: bytes | bytearray | memoryview) -> bytearray:
    """A writable copy of ``run``, in this thread's scratch buffer when the last run had the same length (the
    usual case: runs of a fetch size of records of one size) and it is at most :data:`_SCRATCH_MAX_BYTES`.
    A fresh buffer per run cost a third of a storage node's CPU in a bulk read (megabytes of new pages
    faulted in on every run), where a copy into pages already mapped is a memcpy."""
    n = len(run)
    buf: bytearray | None = getattr(_scratch, "buf", None)
    if buf is not None and len(buf) == n:
        with memoryview(buf) as view:
            view[:] = run  # a memcpy (a slice assignment to the bytearray costs twice as much)
        return buf
    buf = bytearray(run)
    if n <= _SCRATCH_MAX_BYTES:
        _scratch.buf = buf
    return buf


_ID_LIMIT = 2**63
_BYTE_VALUES = bytes(range(256))


def _id_lane(first: int, count: int, shift: int) -> bytes:
    """Byte ``(id >> shift) & 0xFF`` of each id ``first, ..., first + count - 1``, in order, built from runs
    of equal bytes (a byte above the lowest changes once every ``2**shift`` ids) rather than id by id."""
    if shift == 0:
        start = first & 0xFF
        return (_BYTE_VALUES * ((start + count + 255) // 256))[start : start + count]
    parts = []
    i = 0
    while i < count:
        value = (first + i) >> shift
        end = min(count, ((value + 1) << shift) - first)
        parts.append(_BYTE_VALUES[value & 0xFF : (value & 0xFF) + 1] * (end - i))
        i = end
    return b"".join(parts)


@functools.lru_cache(maxsize=256)
def _canonical_crc(size: int, count: int, covered: int) -> int:
    """The CRC-32 of ``count`` records of ``size`` bytes, each ``size - 4`` zero bytes and then, in
    little-endian order, the CRC-32 of ``covered`` zero bytes (verifying records in the fast check's form)."""
    record = bytes(size - 4) + crc32(bytes(covered)).to_bytes(4, "little")
    full, rest = divmod(count, _CANONICAL_BLOCK_RECORDS)
    block = record * _CANONICAL_BLOCK_RECORDS
    value = 0
    for _ in range(full):
        value = crc32(block, value)
    return crc32(record * rest, value)


def uniform_run_verifies(
    run: bytes | bytearray | memoryview, first: int, size: int, count: int, *, data_checksums: bool = True
) -> bool:
    """Whether ``run`` is ``count`` records of ``size`` bytes each, with the ids ``first, first + 1, ...``,
    each length field saying ``size``, and each record checksum (and, with ``data_checksums``, each data
    checksum) verifying; checked without a Python loop over the records (see the comment above). False says
    only that something is wrong: the caller then runs its per-record check, which says what."""
    if size < STORED_OVERHEAD_BYTES or count < 1 or len(run) != size * count:
        return False
    if first < 0 or first + count > _ID_LIMIT:
        return False  # ids no record can carry: the loop says so
    length = (size - STORED_OVERHEAD_BYTES).to_bytes(4, "big")
    # Every lane is read from the copy, a bytearray whatever the run is (a memoryview's extended slices are
    # views, and comparing them goes element by element), before the copy is changed.
    copy = _scratch_copy(run)
    # One byte lane at a time: copy[j::size] is byte j of every record (the ids are big-endian i64s).
    if any(copy[j::size] != _id_lane(first, count, 8 * (7 - j)) for j in range(8)):
        return False
    if any(copy[28 + j :: size] != length[j : j + 1] * count for j in range(4)):
        return False
    record_checksum = [copy[size - 4 + j :: size] for j in range(4)]
    data_checksum = [copy[32 + j :: size] for j in range(4)] if data_checksums else []
    for j in range(4):
        copy[size - 4 + j :: size] = record_checksum[3 - j]
    if crc32(copy) != _canonical_crc(size, count, size - 4):
        return False
    if not data_checksums:
        return True
    zeros = bytes(count)
    for j in range(STORED_HEADER_BYTES):
        copy[j::size] = zeros
    for j in range(4):
        copy[size - 4 + j :: size] = data_checksum[3 - j]  # the data checksum (bytes 32-35), reversed
    return bool(crc32(copy) == _canonical_crc(size, count, size - STORED_OVERHEAD_BYTES))


def run_bounds(run: bytes | bytearray | memoryview, first: int, count: int) -> list[int]:
    """Verify a run whole: ``count`` records with the ids ``first, first + 1, ...``, every length inside the
    run, nothing left over, and both checksums of every record. Returns where each record starts and, last,
    the run's length (``count + 1`` offsets): record ``i`` is ``run[b[i] : b[i + 1]]``, its data
    ``run[b[i] + STORED_HEADER_BYTES : b[i + 1] - 4]``.

    This is the one loop every unpacker runs, so it touches only what the checks need (one 3-field unpack
    and two CRC-32s per record): columnar readers take the fields out of the run afterwards, by column.
    """
    if count < 0 or count * STORED_OVERHEAD_BYTES > len(run):
        raise RemoteProtocolError(f"a run of {len(run)} bytes cannot hold {count} records")
    if count >= _FAST_MIN_RECORDS and (
        isinstance(run, bytes | bytearray) or (run.ndim == 1 and run.format == "B" and run.c_contiguous)
    ):
        size = STORED_OVERHEAD_BYTES + int.from_bytes(run[28:32], "big", signed=True)
        if size * count == len(run) and uniform_run_verifies(run, first, size, count):
            return list(range(0, len(run) + 1, size))
    return _run_bounds_loop(run, first, count)


def _run_bounds_loop(run: bytes | bytearray | memoryview, first: int, count: int) -> list[int]:
    """:func:`run_bounds` record by record: any run, and the one that names a damaged record."""
    view = memoryview(run)
    unpack = _PREFIX_CHECKED.unpack_from
    crc = crc32
    u32 = _U32.unpack_from
    size = len(run)
    bounds = [0] * (count + 1)
    pos = 0
    for i in range(count):
        if pos + STORED_OVERHEAD_BYTES > size:
            raise RemoteProtocolError(f"run ends after {i} of {count} records")
        txn, n, data_crc = unpack(run, pos)
        if txn != first + i:
            raise RemoteProtocolError(f"run record {i}: transaction {txn}, expected {first + i}")
        end = pos + STORED_HEADER_BYTES + n
        if n < 0 or end + 4 > size:
            raise RemoteProtocolError(f"run record {i} (transaction {txn}): bad length {n}")
        # Inline fast path of _check_record: this loop runs for every record a bulk reader sees.
        if crc(view[pos:end]) != u32(run, end)[0] or crc(view[pos + STORED_HEADER_BYTES : end]) != data_crc:
            _check_record(run, view, pos, end, txn, data_crc)
        pos = end + 4
        bounds[i + 1] = pos
    if pos != size:
        raise RemoteProtocolError(f"{size - pos} bytes left over after {count} run records")
    return bounds


def run_records(run: bytes | bytearray | memoryview, first: int, count: int) -> list[Record]:
    """The ``count`` records of a run from ``first``, every checksum verified."""
    bounds = run_bounds(run, first, count)
    view = memoryview(run)
    unpack = STORED_PREFIX.unpack_from
    data_at = STORED_HEADER_BYTES
    out = []
    for i in range(count):
        pos = bounds[i]
        _, msb, lsb, header, _, data_crc = unpack(run, pos)
        out.append(
            make_record(first + i, msb, lsb, header, bytes(view[pos + data_at : bounds[i + 1] - 4]), data_crc)
        )
    return out


def run_columns(
    run: bytes | bytearray | memoryview, first: int, count: int, *, include_data: bool = True
) -> RunColumns:
    """The run unpacked column-wise (see :class:`RunColumns`), every checksum verified."""
    bounds = run_bounds(run, first, count)
    view = memoryview(run)
    headers = [_I32.unpack_from(run, pos + 24)[0] for pos in bounds[:-1]]
    req_ids = b"".join([view[pos + 8 : pos + 24] for pos in bounds[:-1]])
    if not include_data:
        return RunColumns(first, count, headers, req_ids, b"", [])
    data_at = STORED_HEADER_BYTES
    data = b"".join([view[a + data_at : b - 4] for a, b in itertools.pairwise(bounds)])
    offsets = [0] * (count + 1)
    total = 0
    for i in range(count):
        total += bounds[i + 1] - bounds[i] - STORED_OVERHEAD_BYTES
        offsets[i + 1] = total
    return RunColumns(first, count, headers, req_ids, data, offsets)
