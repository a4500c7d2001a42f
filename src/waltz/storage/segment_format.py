"""One segment of a partition's log: a data file ``%019d.seg`` and an index file ``%019d.idx``.

Both files are named after the segment's first transaction id and begin with the same 128-byte header (all
integers big-endian)::

    offset  size  field
         0     4  i32 format version (0)
         4     8  i64 creation time, ms since the epoch
        12     8  i64 cluster key, most significant half of the UUID
        20     8  i64 cluster key, least significant half
        28     4  i32 partition id
        32     8  i64 first transaction id
        40    88  zero padding (reserved)

Opening a segment checks the version, key, partition id and first id of both headers.

The data file then holds records back to back, each ``40 + n`` bytes (so consecutive records form a
*record run*, :mod:`waltz.protocol.record_run`, which range reads send as they are)::

         0     8  i64 transaction id
         8     8  u64 ReqId most significant half
        16     8  u64 ReqId least significant half
        24     4  i32 application header
        28     4  i32 n, the data length
        32     4  u32 data checksum: the client's CRC-32 of the data
        36     n  data
      36+n     4  u32 record checksum: CRC-32 of bytes 0 .. 36+n-1 (the 36-byte record header and the data)

**A data file may end in zeros.** The writable segment's data file is kept zero-filled ahead of its last
record (``storage.segment.preallocateBytes``, :meth:`Segment.prefill`): overwriting blocks that were already
written and fsynced spares the ``fdatasync`` a journal commit of the file's size, which makes it take about
half the time of an extending write's on ext4. The data file's *logical* end is the end of its last record,
not its size: what follows is free space, never records and never corruption. Zeros cannot pass for a
record: an all-zero record header says ``n = 0`` and its record checksum 0, but the CRC-32 of 36 zero bytes is
``0x6ab6b2d5``, so every scan stops at the first zero byte of the tail. A segment that stops being writable
(rolled over, closed) has its zero tail cut (``ftruncate`` to the logical end, fsynced before the next
segment exists), so older segments end with their last record as before; index recovery cuts the last
segment's zeros with its torn records (the zeros are written again afterwards).

The index file holds, after its header, one i64 per record: entry ``i`` at ``128 + 8·i`` is the data-file
offset of transaction ``first + i``; the index length gives the max id (``first + (size - 128) // 8 - 1``) of
a closed segment. The writable segment's newest entries (at most 1000, those after the last checkpoint)
live in memory until the next checkpoint, close, truncation or :meth:`Segment.sync`; the storage node also
writes (without an fsync) those of the records its group fsyncs made durable, a little later
(:meth:`Segment.write_flushed_index`, :mod:`waltz.storage.index_writes`). **An index entry reaches the file
only after an fsync of the data file covered its record**, so an entry on disk proves its record was durable
(recovery relies on it).

Durability protocol (what recovery relies on):

* an append batch is written with one ``pwrite`` to the data file; nothing is fsynced; its index entries wait
  in memory (recovery trusts no entry after the last checkpoint, so writing them per batch bought nothing but
  a syscall and the kernel's work for it on every append);
  :meth:`Segment.flush` fsyncs the data file (the caller's group commit);
* **checkpoint**: before the record whose id is a multiple of ``CHECKPOINT_INTERVAL`` (1000) is written, the
  index entries waiting are written and both files fsynced (unless that record is the segment's first). So if
  the index covers an id ``c = k·1000 > first``, every record and index entry below ``c`` is durable;
* :meth:`Segment.truncate` cuts and fsyncs the data file first, then writes and cuts the index, so a crash
  in between never resurrects truncated records (stale entries point past the end of the data file);
* a new segment's headers are fsynced before its first append; a full segment is fsynced (its zero tail
  cut) before the next one is created;
* zeros are written only past the data file's current end (never over a record, nor where an append is
  about to go: the node writes both from one thread), and recovery never depends on them being durable.

**Index recovery** (:meth:`Segment.open` with ``recover=True``, done for the partition's last segment): the
restart point is the last checkpoint ``c - 1`` covered by the index (``c`` the largest multiple of 1000 with
``first < c <= index max``), whose entry and record are durable by the protocol above; its record must verify
(id and checksum), or the previous checkpoint is tried, down to a rescan from the header. From there the
records are re-verified one by one (id sequence, length inside the file, record checksum), their index entries
rewritten, until the first bad or partial record. A bad record that was durable (its index entry on disk, or
its id at or below the local low-water mark) is damage, not a torn tail: it is kept as a damaged record with
the records after it, one ERROR line, and listed in :attr:`Segment.damaged_at_open` for the node to report
and repair (see :mod:`waltz.storage.resync`). At the first bad record that was not, the data file is
truncated after the last record kept, then fsynced, the index trimmed to match and fsynced. The original
Waltz restarts from ``localLowWaterMark`` when it is higher; we do not, because index entries after the last
checkpoint were never fsynced and may be garbage even when the records are durable (they still prove their
records durable: only their values are not trusted). Rescanning from the checkpoint costs the records from
it to the end of the data file: about 1000 plus those written after the index's last entry.
"""

from __future__ import annotations

import functools
import itertools
import os
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from waltz.errors import CorruptionError, FormatVersionError, StorageError, TransactionOutOfOrderError
from waltz.protocol.checksum import crc32
from waltz.protocol.record_run import encode_run, uniform_run_verifies
from waltz.protocol.records import Record, ReqId, make_req_id
from waltz.protocol.storage import WireRecordList
from waltz.version import __version__

FORMAT_VERSION = 0
SEGMENT_HEADER_BYTES = 128
RECORD_HEADER_BYTES = 36
RECORD_OVERHEAD_BYTES = 40
INDEX_ENTRY_BYTES = 8
CHECKPOINT_INTERVAL = 1000
MAX_READ_RECORDS = 10_000
"""Upper bound on the records one read call returns."""
MAX_DAMAGED_AT_OPEN = 1000
"""Most damaged ids recovery lists in :attr:`Segment.damaged_at_open` (it logs every range)."""
DEFAULT_MAX_READ_BYTES = 16 * 1024 * 1024
"""Default bound on the bytes one list read loads (at least one record is always returned)."""
SCAN_CHUNK_BYTES = 1024 * 1024
"""Recovery and verification read the data file in chunks of this size."""
MAX_RECORD_DATA_BYTES = 2**31 - 1
PREFILL_CHUNK_BYTES = 256 * 1024
"""Most zeros one :meth:`Segment.prefill` step writes (one write of this much; the storage node lets the
next group fsync carry it). Large enough that it is rare (every ~16 group commits of 30 records of 512
bytes), small enough that its write barely holds the loop and that the group fsync carrying it, which waits
for the zeros' writeback too, is not held long (larger chunks raise the append p99)."""
_ZEROS = bytes(PREFILL_CHUNK_BYTES)

_HEADER = struct.Struct(">iqqqiq")
_PREFIX = struct.Struct(">qQQiiI")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_MASK32 = 0xFFFFFFFF
_WIRE_PREFIX_BYTES = 32
_BULK_MAX_RECORDS = 128  # records checked and converted by one set of structs (see _append_uniform_wire_run)
_BULK_MIN_RECORDS = 4  # appends of fewer records go through the per-record loop (the bulk path's set-up)
_FAST_CHECK_MIN_RECORDS = 16  # below this a run is checked by the per-record loop (the fast check's set-up)
"""Bytes a wire record and a stored record share at their start: id, ReqId, header, data length."""


class RecordCorruptionError(CorruptionError):
    """A stored record that does not verify (checksum, id or length): names the transaction, so the node can
    report that replica's copy as damaged and accept a repair of it. Sent on the wire as CorruptionError."""

    def __init__(self, message: str, transaction_id: int) -> None:
        super().__init__(message)
        self.transaction_id = transaction_id


def data_file_name(first_transaction_id: int) -> str:
    return f"{first_transaction_id:019d}.seg"


def index_file_name(first_transaction_id: int) -> str:
    return f"{first_transaction_id:019d}.idx"


def parse_segment_name(name: str) -> tuple[int, str] | None:
    """``(first id, ".seg" | ".idx")`` for a segment file name, else None."""
    stem, ext = os.path.splitext(name)
    if ext in (".seg", ".idx") and len(stem) == 19 and stem.isdigit():
        return int(stem), ext
    return None


@dataclass(frozen=True)
class SegmentHeader:
    """The 128-byte header shared by a segment's data and index files."""

    version: int
    creation_time_ms: int
    key: uuid.UUID
    partition_id: int
    first_transaction_id: int

    def encode(self) -> bytes:
        msb = _signed64(self.key.int >> 64)
        lsb = _signed64(self.key.int & ((1 << 64) - 1))
        raw = _HEADER.pack(
            self.version, self.creation_time_ms, msb, lsb, self.partition_id, self.first_transaction_id
        )
        return raw + bytes(SEGMENT_HEADER_BYTES - len(raw))

    @classmethod
    def decode(cls, raw: bytes, path: str) -> SegmentHeader:
        if len(raw) < SEGMENT_HEADER_BYTES:
            raise CorruptionError(
                f"{path}: segment header is {len(raw)} bytes, expected {SEGMENT_HEADER_BYTES}"
            )
        version, created, msb, lsb, pid, first = _HEADER.unpack_from(raw, 0)
        if version != FORMAT_VERSION:
            raise FormatVersionError(
                f"{path}: segment format version {version}, but Waltz {__version__} reads version "
                f"{FORMAT_VERSION}: was it written by a newer release?"
            )
        key = uuid.UUID(int=((msb & ((1 << 64) - 1)) << 64) | (lsb & ((1 << 64) - 1)))
        return cls(version, created, key, pid, first)


def encode_record(rec: Record) -> bytes:
    """One record as stored in a ``.seg`` file, a record run of one (for tests and tools; appends build
    batches in place)."""
    return encode_run((rec,))


def verify_client_checksums(records: Sequence[Record], first_transaction_id: int) -> None:
    """Check that ``records`` continue densely from ``first_transaction_id`` and each data matches its CRC-32.

    Raises TransactionOutOfOrderError or CorruptionError; called right before anything is written.
    """
    expected = first_transaction_id
    for rec in records:
        if rec.transaction_id != expected:
            raise TransactionOutOfOrderError(
                f"transaction out of order: expected {expected}, got {rec.transaction_id}"
            )
        if crc32(rec.data) != rec.checksum:
            raise CorruptionError(
                f"transaction {expected}: data does not match its checksum {rec.checksum:#010x}; not written"
            )
        if len(rec.data) > MAX_RECORD_DATA_BYTES:
            raise StorageError(f"transaction {expected}: {len(rec.data)} bytes of data is too large")
        expected += 1


def encode_stored_run(records: Sequence[Record]) -> tuple[bytes, list[int]]:
    """``records`` as a stored run, and where each record ends in it (see :meth:`Segment.append_run`)."""
    run = encode_run(records)
    ends: list[int] = []
    pos = 0
    for rec in records:
        pos += RECORD_OVERHEAD_BYTES + len(rec.data)
        ends.append(pos)
    return run, ends


def append_wire_run(
    parts: list[bytes | memoryview], ends: list[int], records: WireRecordList, first_transaction_id: int
) -> None:
    """Append ``records`` (as an AppendRequest carried them) to ``parts`` in the stored layout, and the end
    offset of each to ``ends`` (offsets in ``b"".join(parts)``): the append path, without a Record object
    per record and without copying the data until the join.

    Each record is checked right before it joins the run: its id continues densely from
    ``first_transaction_id`` and its data matches the client's CRC-32 (TransactionOutOfOrderError,
    CorruptionError). The wire and stored layouts share their first 32 bytes (id, ReqId, header, length), so
    a stored record is those bytes, the data checksum, the data and a new record checksum. If a record is
    refused, ``parts`` and ``ends`` are left as they were.
    """
    buf = records.buffer
    starts = records.starts
    if (
        records.record_bytes
        and len(starts) > _BULK_MIN_RECORDS
        and _append_uniform_wire_run(
            parts, ends, buf, starts[0], len(starts) - 1, records.record_bytes, first_transaction_id
        )
    ):
        return
    # Not of one size, or something does not verify: the loop finds the first record that does not, says why.
    mark = len(parts)
    marked_ends = len(ends)
    pos = ends[-1] if ends else 0
    view = memoryview(buf)  # of immutable bytes: its slices need no release
    crc = crc32
    unpack_id = _I64.unpack_from
    unpack_u32 = _U32.unpack_from
    pack_u32 = _U32.pack
    add = parts.append
    end_at = ends.append
    expected = first_transaction_id
    # Walked as (start, next start) pairs from one iterator: indexing ``starts`` twice per record cost ~10%.
    following = iter(starts)
    s = next(following)
    try:
        for nxt in following:
            e = nxt - 4  # the end of the data, where the client's checksum begins
            if unpack_id(buf, s)[0] != expected:
                raise TransactionOutOfOrderError(
                    f"transaction out of order: expected {expected}, got {unpack_id(buf, s)[0]}"
                )
            body = view[s + _WIRE_PREFIX_BYTES : e]
            if crc(body) != unpack_u32(buf, e)[0]:
                raise CorruptionError(
                    f"transaction {expected}: data does not match its checksum "
                    f"{unpack_u32(buf, e)[0]:#010x}; not written"
                )
            head = buf[s : s + _WIRE_PREFIX_BYTES] + buf[e:nxt]  # the stored 36-byte record header
            # Parts joined once per group: appending to a bytearray record by record cost a third more.
            add(head)
            add(body)
            add(pack_u32(crc(body, crc(head))))
            pos += nxt - s + 4  # the stored record: 4 bytes longer than the wire one (its record checksum)
            end_at(pos)
            expected += 1
            s = nxt
    except BaseException:
        del parts[mark:]
        del ends[marked_ends:]
        raise


class _UniformWireLayout(NamedTuple):
    """Structs that cut ``count`` wire records of ``data_bytes`` data each, and build their stored run."""

    ids: struct.Struct  # each record's id
    data_checksums: struct.Struct  # each record's data checksum, as an int
    pieces: struct.Struct  # each record's 32-byte prefix, data and data checksum, as bytes
    stored: struct.Struct  # the stored run, from each record's prefix, data checksum, data, record checksum


@functools.lru_cache(maxsize=256)
def _uniform_wire_layout(count: int, data_bytes: int) -> _UniformWireLayout:
    """Cached: building one (parsing its formats) costs ~6 us for 30 records, half of what the bulk path
    saves on them, and a server's batches of one record size come in at most ``_BULK_MAX_RECORDS`` counts.
    Each holds 11 codes of 32 bytes per record: at most ~45 KB, ~11 MB for a full cache."""
    return _UniformWireLayout(
        struct.Struct(">" + f"q{_WIRE_PREFIX_BYTES - 8 + data_bytes + 4}x" * count),
        struct.Struct(">" + f"{_WIRE_PREFIX_BYTES + data_bytes}xI" * count),
        struct.Struct(">" + f"{_WIRE_PREFIX_BYTES}s{data_bytes}s4s" * count),
        struct.Struct(">" + f"{_WIRE_PREFIX_BYTES}s4s{data_bytes}sI" * count),
    )


def _append_uniform_wire_run(
    parts: list[bytes | memoryview],
    ends: list[int],
    buf: bytes,
    start: int,
    count: int,
    wire_bytes: int,
    first_transaction_id: int,
) -> bool:
    """:func:`append_wire_run` of ``count`` wire records of ``wire_bytes`` each from ``buf[start:]``, without
    a Python loop over the records: unpacks cut them all at once, the checks (ids dense from
    ``first_transaction_id``, every data checksum) and the record checksums run as ``map``s in C, and one
    pack builds the stored run. The same checks as the loop, record for record; False (``parts`` and
    ``ends`` untouched) if any fails. A third less CPU than the loop for 30 records of 512 bytes.

    Taken ``_BULK_MAX_RECORDS`` at a time, so the cached structs stay small (their size grows with the count)
    and few (the chunk's count and the remainder's, per record size)."""
    data_bytes = wire_bytes - RECORD_HEADER_BYTES
    stored_bytes = wire_bytes + 4
    pos = ends[-1] if ends else 0
    built: list[bytes] = []
    crc = crc32
    done = 0
    while done < count:
        n = min(_BULK_MAX_RECORDS, count - done)
        first = first_transaction_id + done
        at = start + done * wire_bytes
        layout = _uniform_wire_layout(n, data_bytes)
        if layout.ids.unpack_from(buf, at) != tuple(range(first, first + n)):
            return False
        pieces = layout.pieces.unpack_from(buf, at)
        datas = pieces[1::3]
        if tuple(map(crc, datas)) != layout.data_checksums.unpack_from(buf, at):
            return False
        prefixes = pieces[0::3]
        checksums = pieces[2::3]
        fields: list[bytes | int] = [b""] * (4 * n)
        fields[0::4] = prefixes
        fields[1::4] = checksums
        fields[2::4] = datas
        # The record checksums: CRC-32 of the prefix, then the data checksum, then the data (no 36-byte
        # header is built for it: a concatenation per record cost more than a third CRC call).
        fields[3::4] = list(map(crc, datas, map(crc, checksums, map(crc, prefixes))))
        built.append(layout.stored.pack(*fields))
        done += n
    parts += built
    ends += range(pos + stored_bytes, pos + stored_bytes * count + 1, stored_bytes)
    return True


def _decode_verified(
    raw: bytes | bytearray, start: int, end: int, transaction_id: int, path: str, offset: int
) -> tuple[int, ReqId, int, int]:
    """Check one record at ``raw[start:end]``: id, length, record checksum, data checksum."""
    if end - start < RECORD_OVERHEAD_BYTES:
        raise RecordCorruptionError(
            f"{path}: record {transaction_id} at offset {offset} is truncated", transaction_id
        )
    txn, msb, lsb, header, n, data_crc = _PREFIX.unpack_from(raw, start)
    if txn != transaction_id:
        raise RecordCorruptionError(
            f"{path}: expected transaction {transaction_id} at offset {offset}, found {txn}",
            transaction_id,
        )
    if RECORD_OVERHEAD_BYTES + n != end - start:
        raise RecordCorruptionError(
            f"{path}: record {transaction_id} at offset {offset} has a bad length {n}", transaction_id
        )
    body_end = end - 4
    view = memoryview(raw)
    try:
        stored = _U32.unpack_from(raw, body_end)[0]
        if crc32(view[start:body_end]) != stored:
            raise RecordCorruptionError(
                f"{path}: record {transaction_id} at offset {offset}: record checksum mismatch",
                transaction_id,
            )
        if crc32(view[start + RECORD_HEADER_BYTES : body_end]) != data_crc:
            raise RecordCorruptionError(
                f"{path}: record {transaction_id} at offset {offset}: data checksum mismatch",
                transaction_id,
            )
    finally:
        view.release()
    return txn, make_req_id(msb, lsb), header, data_crc


def _verify_whole(raw: bytes, transaction_id: int, path: str, offset: int) -> object:
    return _decode_verified(raw, 0, len(raw), transaction_id, path, offset)


def _no_entries(entry: int, n: int) -> bytes:
    return b""


def _check_run(raw: bytes, offsets: list[int], first: int, path: str) -> None:
    """Check every record of a loaded run: its id and its record checksum (one CRC-32 per record). This runs
    for every record a range read serves, so the loop body is one length test, one unpack and one CRC."""
    if not offsets:
        return
    base = offsets[0]
    count = len(offsets) - 1
    size = offsets[1] - base if count else 0
    if (
        count >= _FAST_CHECK_MIN_RECORDS
        and offsets[-1] - base == size * count
        and offsets == list(range(base, offsets[-1] + 1, size))
        and uniform_run_verifies(raw, first, size, count, data_checksums=False)
    ):
        # Records of one size (the index says so): ids, lengths and record checksums checked without a
        # Python loop over the records (see waltz.protocol.record_run). Otherwise, or if that check fails,
        # the loop below checks each record and names the one that is damaged.
        return
    view = memoryview(raw)
    unpack_id = _I64.unpack_from
    unpack_crc = _U32.unpack_from
    crc = crc32
    try:
        txn = first
        start = 0
        for offset in itertools.islice(offsets, 1, None):
            end = offset - base
            body_end = end - 4
            if (
                end - start < RECORD_OVERHEAD_BYTES
                or unpack_id(raw, start)[0] != txn
                or crc(view[start:body_end]) != unpack_crc(raw, body_end)[0]
            ):
                # The slow path names exactly what is wrong.
                _decode_verified(raw, start, end, txn, path, start + base)
                raise RecordCorruptionError(
                    f"{path}: record {txn} at offset {start + base} does not verify", txn
                )
            start = end
            txn += 1
    finally:
        view.release()


def _check_header(
    header: SegmentHeader, path: str, key: uuid.UUID | None, partition_id: int | None, first: int
) -> None:
    if key is not None and header.key != key:
        raise CorruptionError(f"{path}: segment belongs to cluster key {header.key}, expected {key}")
    if partition_id is not None and header.partition_id != partition_id:
        raise CorruptionError(
            f"{path}: segment belongs to partition {header.partition_id}, expected {partition_id}"
        )
    if header.first_transaction_id != first:
        raise CorruptionError(
            f"{path}: header says first transaction {header.first_transaction_id}, name says {first}"
        )


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v
