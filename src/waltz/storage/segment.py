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
writes (without an fsync) those of the records each group fsync made durable
(:meth:`Segment.write_flushed_index`). **An index entry reaches the file only after an fsync of the data
file covered its record**, so an entry on disk proves its record was durable (recovery relies on it).

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

import bisect
import functools
import itertools
import logging
import os
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, overload

from waltz.errors import CorruptionError, StorageError, TransactionOutOfOrderError
from waltz.protocol.checksum import crc32
from waltz.protocol.record_run import encode_run, uniform_run_verifies
from waltz.protocol.records import Record, RecordHeader, ReqId, make_req_id
from waltz.protocol.storage import WireRecordList
from waltz.storage.fileio import OS_FS, File, FileSystem
from waltz.storage.resync import damaged_extents, find_next_good, last_end, record_end

log = logging.getLogger(__name__)
_tuple_new = tuple.__new__  # builds Records without the generated __new__ on the read hot path

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
            raise CorruptionError(f"{path}: unsupported segment version {version}")
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


@dataclass
class ZeroFill:
    """Zeros :meth:`Segment.prefill` wrote past the last record, not yet durable: :meth:`sync` them (in any
    thread: it uses a descriptor of its own), then call :meth:`done` where the segment is used."""

    segment: Segment
    start: int
    end: int
    """The zeros are ``[start, end)`` of the data file."""
    epoch: int
    handle: File

    def sync(self) -> None:
        """Fsync the zeros (with the file's new size) and close the handle, even if the fsync fails."""
        try:
            self.handle.fsync()
        finally:
            self.handle.close()

    def done(self) -> None:
        """Count the zeros as durable (unless a truncation cut them meanwhile)."""
        self.segment._zeros_synced(self.end, self.epoch)


class Segment:
    """One open segment. Not thread-safe: its partition's single owner calls it.

    A writable segment accepts appends and truncation; a read-only one only reads. Reads verify every record
    checksum right after reading and raise CorruptionError on a mismatch.
    """

    def __init__(
        self,
        directory: str,
        header: SegmentHeader,
        data: File,
        index: File,
        count: int,
        data_size: int,
        writable: bool,
    ) -> None:
        self.directory = directory
        self.header = header
        self.first_transaction_id = header.first_transaction_id
        self.data_path = os.path.join(directory, data_file_name(header.first_transaction_id))
        self.index_path = os.path.join(directory, index_file_name(header.first_transaction_id))
        self._data: File | None = data
        self._index: File | None = index
        self._count = count
        self._data_size = data_size
        self.writable = writable
        self._data_dirty = False
        self._index_dirty = False
        self._flushed_count = count
        """Records the last fsync of the data file covered (see :meth:`write_flushed_index`)."""
        self._index_tail = bytearray()
        """Index entries of the newest records, not yet written to the index file (at most
        ``CHECKPOINT_INTERVAL``): written by :meth:`sync` (every checkpoint, close, truncation)."""
        self._records_end: int | None = None
        """Where the last record ends when bytes that are no record follow it (a tool's view of a torn tail:
        :meth:`_adopt_unindexed_records`); None when the data file ends with it."""
        self._zeros_durable_end = data_size
        """The data file holds fsynced zeros up to here past the last record (see :meth:`prefill`)."""
        self._zero_epoch = 0
        """Bumped when a truncation cuts the file: a :class:`ZeroFill` of before then counts for nothing."""
        self.extending_writes = 0
        """Data-file writes that reached past the fsynced zeros (see :meth:`prefill`): they extended the file
        (or overwrote zeros whose fsync had not returned yet) and so cost their fsync a journal commit."""
        self.zero_tail_bytes = 0
        """For tools: the bytes of zeros after the last record (and after any torn bytes) that
        :meth:`inspect` found and left out of :attr:`size_bytes`."""
        self.damaged_at_open: list[int] = []
        self.lost_at_open: str | None = None
        """Set by index recovery when durable records were lost, not merely damaged (they read as zeros up
        to the end): the node then reports the replica damaged (see waltz.storage.replica_check)."""
        """Ids index recovery kept as damaged records (durable, not verifying; see
        :mod:`waltz.storage.resync`), at most ``MAX_DAMAGED_AT_OPEN``: the node reports them."""

    # ------------------------------------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls,
        fs: FileSystem,
        directory: str,
        key: uuid.UUID,
        partition_id: int,
        first_transaction_id: int,
        *,
        clock_ms: Callable[[], int] | None = None,
    ) -> Segment:
        """Create an empty writable segment; both headers are fsynced before this returns."""
        now = clock_ms() if clock_ms is not None else time.time_ns() // 1_000_000
        header = SegmentHeader(FORMAT_VERSION, now, key, partition_id, first_transaction_id)
        raw = header.encode()
        files: list[File] = []
        try:
            for name in (data_file_name(first_transaction_id), index_file_name(first_transaction_id)):
                f = fs.open(os.path.join(directory, name), create=True)
                files.append(f)
                f.truncate(0)
                f.pwrite(raw, 0)
                f.fsync()
            fs.fsync_dir(directory)
        except BaseException:
            for f in files:
                f.close()
            raise
        return cls(directory, header, files[0], files[1], 0, SEGMENT_HEADER_BYTES, True)

    @classmethod
    def open(
        cls,
        fs: FileSystem,
        directory: str,
        first_transaction_id: int,
        *,
        key: uuid.UUID | None,
        partition_id: int | None,
        writable: bool = False,
        recover: bool = False,
        local_low_water_mark: int = -1,
    ) -> Segment:
        """Open an existing segment, checking both headers; ``recover`` runs index recovery."""
        if recover and not writable:
            raise StorageError("index recovery needs a writable segment")
        data_path = os.path.join(directory, data_file_name(first_transaction_id))
        index_path = os.path.join(directory, index_file_name(first_transaction_id))
        data = fs.open(data_path, read_only=not writable)
        try:
            index = fs.open(index_path, read_only=not writable)
        except BaseException:
            data.close()
            raise
        try:
            header = SegmentHeader.decode(data.pread(SEGMENT_HEADER_BYTES, 0), data_path)
            index_header = SegmentHeader.decode(index.pread(SEGMENT_HEADER_BYTES, 0), index_path)
            _check_header(header, data_path, key, partition_id, first_transaction_id)
            _check_header(index_header, index_path, header.key, header.partition_id, first_transaction_id)
            count = max(0, (index.size() - SEGMENT_HEADER_BYTES) // INDEX_ENTRY_BYTES)
            seg = cls(directory, header, data, index, count, data.size(), writable)
            if recover:
                seg._recover(local_low_water_mark)
        except BaseException:
            data.close()
            index.close()
            raise
        return seg

    @classmethod
    def inspect(cls, data_path: str, *, fs: FileSystem = OS_FS) -> Segment:
        """Open a segment read-only from its ``.seg`` path, for tools: no key check, no recovery; the records
        that verify after the index's end count (see :meth:`_adopt_unindexed_records`)."""
        parsed = parse_segment_name(os.path.basename(data_path))
        if parsed is None or parsed[1] != ".seg":
            raise StorageError(
                f"{data_path}: not a segment data file name (expected NNNNNNNNNNNNNNNNNNN.seg)"
            )
        seg = cls.open(fs, os.path.dirname(data_path) or ".", parsed[0], key=None, partition_id=None)
        try:
            seg._adopt_unindexed_records()
        except BaseException:
            seg.close()
            raise
        return seg

    def close(self) -> None:
        """Close both files; a writable segment has its zero tail cut and is fsynced first, so that it ends
        with its last record as every older segment does. Idempotent."""
        if self._data is None or self._index is None:
            return
        try:
            if self.writable:
                self._cut_zero_tail()
                self.sync()
        finally:
            data, index = self._data, self._index
            self._data = self._index = None
            data.close()
            index.close()

    @property
    def closed(self) -> bool:
        return self._data is None

    def _files(self) -> tuple[File, File]:
        if self._data is None or self._index is None:
            raise StorageError(f"{self.data_path}: segment is closed")
        return self._data, self._index

    # -------------------------------------------------------------------------------------------- state

    @property
    def max_transaction_id(self) -> int:
        """The last transaction id held, ``first - 1`` when empty."""
        return self.first_transaction_id + self._count - 1

    @property
    def next_transaction_id(self) -> int:
        return self.first_transaction_id + self._count

    @property
    def record_count(self) -> int:
        return self._count

    @property
    def size_bytes(self) -> int:
        """The data file's logical size: the header and the records (the end of the last one), without the
        zeros preallocated after them (see :meth:`prefill`)."""
        return self._data_size

    @property
    def prefilled_bytes(self) -> int:
        """Bytes of fsynced zeros right after the last record: what the next appends overwrite without
        changing the file's size or allocating blocks."""
        data_file, _ = self._files()
        return max(0, min(self._zeros_durable_end, data_file.size()) - self._data_size)

    # ------------------------------------------------------------------------------------------- writes

    def append(
        self, records: Sequence[Record], start: int = 0, *, size_threshold_bytes: int | None = None
    ) -> int:
        """Verify and write ``records[start:]`` (ids continuing this segment); return how many were written.

        Writing stops after the record that takes the data file past ``size_threshold_bytes`` (the caller then
        continues in a new segment). See :meth:`append_run`; nothing is fsynced but at a checkpoint: call
        :meth:`flush`.
        """
        todo = records[start:]
        verify_client_checksums(todo, self.next_transaction_id)
        run, ends = encode_stored_run(todo)
        return self.append_run(run, ends, 0, size_threshold_bytes=size_threshold_bytes)

    def append_run(
        self,
        run: bytes | bytearray,
        ends: Sequence[int],
        start: int = 0,
        *,
        size_threshold_bytes: int | None = None,
    ) -> int:
        """Write records ``start..`` of a stored run whose ids continue this segment; return how many were
        written. ``ends[k]`` is the end offset in ``run`` of record ``k`` (record 0 begins at offset 0).

        The run was checked by whoever built it (:func:`append_wire_run`, :func:`verify_client_checksums`):
        ids dense, data checksums right, record checksums computed. Writing stops after the record that takes
        the data file past ``size_threshold_bytes``. Each stretch of records is one ``pwrite`` to the data
        file (the index entries wait in memory); a run is split only at a checkpoint id (a multiple of 1000),
        before which the index entries waiting are written and both files fsynced.
        """
        data_file, _ = self._files()
        if not self.writable:
            raise StorageError(f"{self.data_path}: segment is read-only")
        threshold = size_threshold_bytes if size_threshold_bytes is not None else 1 << 62
        i = start
        total = len(ends)
        view = memoryview(run)
        try:
            while i < total and self._data_size <= threshold:
                next_id = self.next_transaction_id
                if next_id % CHECKPOINT_INTERVAL == 0 and self._count > 0:
                    self._checkpoint()
                # This stretch ends before the next checkpoint id, or after the record crossing the threshold.
                j = min(total, i + CHECKPOINT_INTERVAL - next_id % CHECKPOINT_INTERVAL)
                run_base = ends[i - 1] if i else 0
                base = self._data_size
                if base + ends[j - 1] - run_base > threshold:
                    j = bisect.bisect_right(ends, threshold - base + run_base, i, j) + 1
                data_file.pwrite(view[run_base : ends[j - 1]], base)
                if base + ends[j - 1] - run_base > self._zeros_durable_end:
                    self.extending_writes += 1
                # The index entries wait in memory for the next checkpoint (see _index_tail): recovery never
                # trusts entries after the last checkpoint anyway, and their pwrite cost a syscall per append
                # request (~2 us of CPU here).
                self._index_tail += struct.pack(
                    f">{j - i}q", base, *map((base - run_base).__add__, ends[i : j - 1])
                )
                self._data_size = base + ends[j - 1] - run_base
                self._count += j - i
                self._data_dirty = True
                i = j
        finally:
            view.release()
        return i - start

    def prefill(self, ahead_bytes: int, limit_bytes: int) -> ZeroFill | None:
        """Keep the data file zero-filled ``ahead_bytes`` past the last record (never past ``limit_bytes``,
        where the segment rolls over): when a chunk (``min(PREFILL_CHUNK_BYTES, ahead_bytes // 2)``) is
        missing, write one at the file's end, not fsynced, and return it; None when nothing is missing. The
        next :meth:`flush` or :meth:`sync` makes it durable (then call :meth:`ZeroFill.done`), or
        :meth:`ZeroFill.sync` through a descriptor of its own (which, failing, may consume the report of a
        writeback error of the records' pages: the storage node leaves the zeros to its next group fsync).

        Zeros go only past the file's end, which is at or past the end of the last record, so they never
        land on a record; call it from the thread that appends. Appends that outrun the zeros still work
        (they extend the file, as without preallocation), and recovery never relies on the zeros (they fail
        every record check, see the module docstring).
        """
        data_file, _ = self._files()
        if not self.writable:
            raise StorageError(f"{self.data_path}: segment is read-only")
        # Half the distance at most, so the next chunk is written while the other half is still ahead.
        chunk = min(PREFILL_CHUNK_BYTES, ahead_bytes // 2)
        size = data_file.size()
        if chunk <= 0 or size - self._data_size > ahead_bytes - chunk:
            return None
        end = min(size + chunk, limit_bytes)
        if end <= size:
            return None
        with memoryview(_ZEROS) as zeros:
            data_file.pwrite(zeros[: end - size], size)
        self._data_dirty = True  # the next flush syncs them too (a node leaves them to its next group fsync)
        return ZeroFill(self, size, end, self._zero_epoch, data_file.duplicate())

    def _zeros_synced(self, end: int, epoch: int) -> None:
        if epoch == self._zero_epoch:
            self._zeros_durable_end = max(self._zeros_durable_end, end)

    def _cut_zero_tail(self) -> None:
        """Cut the data file at the end of the last record (durable at the next fsync of the data file)."""
        data_file, _ = self._files()
        if data_file.size() > self._data_size:
            data_file.truncate(self._data_size)
            self._zero_epoch += 1
            self._zeros_durable_end = self._data_size
            self._data_dirty = True

    def _checkpoint(self) -> None:
        # Everything below the checkpoint id becomes durable before that id is written: index recovery then
        # trusts the index up to the last checkpoint it covers.
        self.sync()

    def flush(self) -> None:
        """Make every appended record durable (fsync of the data file; the index waits for a checkpoint, or
        for :meth:`write_flushed_index`)."""
        data_file, _ = self._files()
        covered = self._count
        if self._data_dirty:
            data_file.fsync(data_only=True)
            self._data_dirty = False
        self._flushed_count = covered

    def write_flushed_index(self) -> None:
        """Write the index entries waiting in memory of the records the last :meth:`flush` made durable, not
        fsynced: one ``pwrite`` that lets recovery after a process kill know those records were durable (and
        so keep one that does not verify as damage, not cut it as a torn tail: see waltz.storage.resync)."""
        tail = self._index_tail
        written = self._count - len(tail) // INDEX_ENTRY_BYTES
        n = min(len(tail) // INDEX_ENTRY_BYTES, self._flushed_count - written)
        if n <= 0:
            return
        _, index_file = self._files()
        index_file.pwrite(tail[: INDEX_ENTRY_BYTES * n], SEGMENT_HEADER_BYTES + INDEX_ENTRY_BYTES * written)
        del tail[: INDEX_ENTRY_BYTES * n]
        self._index_dirty = True

    def sync(self) -> None:
        """Make the data file and the index durable."""
        data_file, index_file = self._files()
        # The data file first: an index entry on disk must only ever name a durable record, so that recovery
        # can tell damage from a torn tail (see waltz.storage.resync).
        if self._data_dirty:
            data_file.fsync(data_only=True)
            self._data_dirty = False
        self._flushed_count = self._count
        self._write_index_tail()
        if self._index_dirty:
            index_file.fsync(data_only=True)
            self._index_dirty = False

    def _write_index_tail(self) -> None:
        tail = self._index_tail
        if tail:
            _, index_file = self._files()
            written = self._count - len(tail) // INDEX_ENTRY_BYTES
            index_file.pwrite(tail, SEGMENT_HEADER_BYTES + INDEX_ENTRY_BYTES * written)
            self._index_tail = bytearray()
            self._index_dirty = True

    def truncate(self, transaction_id: int) -> None:
        """Keep the records ``<= transaction_id``; durable when this returns."""
        data_file, index_file = self._files()
        if not self.writable:
            raise StorageError(f"{self.data_path}: segment is read-only")
        if transaction_id < self.first_transaction_id - 1:
            raise StorageError(
                f"{self.data_path}: cannot truncate to {transaction_id}, before the segment's first id"
            )
        if transaction_id >= self.max_transaction_id:
            self.sync()
            return
        keep = transaction_id - self.first_transaction_id + 1
        cut = self._offset_of(keep) if keep > 0 else SEGMENT_HEADER_BYTES
        # Data first: once the records are gone durably, a stale index can only point past the end of the
        # data, which recovery detects; the other order could resurrect truncated records.
        data_file.truncate(cut)
        data_file.fsync()
        # Only now the index entries waiting in memory: those it keeps name records the fsync made durable.
        self._write_index_tail()
        index_file.truncate(SEGMENT_HEADER_BYTES + INDEX_ENTRY_BYTES * keep)
        index_file.fsync()
        self._count = self._flushed_count = keep
        self._data_size = self._zeros_durable_end = cut
        self._zero_epoch += 1  # the zeros went with the records; the next prefill writes them again
        self._data_dirty = self._index_dirty = False

    # -------------------------------------------------------------------------------------------- reads

    def _index_entries(self, entry: int, n: int) -> bytes | bytearray:
        """Index entries ``entry .. entry+n-1`` as stored (shorter if the index file is), from the file and
        the entries not yet written to it: the newest records' offsets need no pread."""
        tail = self._index_tail
        written = self._count - len(tail) // INDEX_ENTRY_BYTES
        if entry >= written:
            lo = (entry - written) * INDEX_ENTRY_BYTES
            return tail[lo : lo + INDEX_ENTRY_BYTES * n]
        _, index_file = self._files()
        in_file = min(n, written - entry)
        raw = index_file.pread(INDEX_ENTRY_BYTES * in_file, SEGMENT_HEADER_BYTES + INDEX_ENTRY_BYTES * entry)
        if in_file < n and len(raw) == INDEX_ENTRY_BYTES * in_file:
            raw += tail[: INDEX_ENTRY_BYTES * (n - in_file)]
        return raw

    def _offset_of(self, entry: int) -> int:
        raw = self._index_entries(entry, 1)
        if len(raw) != INDEX_ENTRY_BYTES:
            raise CorruptionError(f"{self.index_path}: index entry {entry} is missing")
        return int(_I64.unpack(raw)[0])

    def _offsets(self, entry: int, count: int) -> list[int]:
        """Offsets of records ``entry .. entry+count-1`` plus the end of the last one (count + 1 values)."""
        with_next = entry + count < self._count
        n = count + 1 if with_next else count
        raw = self._index_entries(entry, n)
        if len(raw) != INDEX_ENTRY_BYTES * n:
            raise CorruptionError(f"{self.index_path}: index is shorter than {self._count} entries")
        offsets = list(struct.unpack(f">{n}q", raw))
        if not with_next:
            offsets.append(self._data_size if self._records_end is None else self._records_end)
        prev = SEGMENT_HEADER_BYTES
        for o in offsets:
            if o < prev or o > self._data_size:
                raise CorruptionError(
                    f"{self.index_path}: bad index entry near transaction "
                    f"{self.first_transaction_id + entry}: offset {o}"
                )
            prev = o
        return offsets

    def _range(self, transaction_id: int, max_count: int) -> int:
        if max_count <= 0:
            return 0
        if transaction_id < self.first_transaction_id or transaction_id > self.max_transaction_id:
            return 0
        return min(max_count, MAX_READ_RECORDS, self.max_transaction_id - transaction_id + 1)

    def _load(self, transaction_id: int, max_count: int, max_bytes: int) -> tuple[bytes, list[int]]:
        """Whole records from ``transaction_id`` with one ``pread``: at least one, at most ``max_count`` and
        ``max_bytes``. Returns their bytes and data-file offsets plus the end of the last (``k + 1`` values
        for ``k`` records); ``(b"", [])`` if the segment does not hold ``transaction_id``."""
        count = self._range(transaction_id, max_count)
        if count == 0:
            return b"", []
        data_file, _ = self._files()
        offsets = self._offsets(transaction_id - self.first_transaction_id, count)
        base = offsets[0]
        k = 1
        while k < count and offsets[k + 1] - base <= max_bytes:
            k += 1
        raw = data_file.pread(offsets[k] - base, base)
        if len(raw) != offsets[k] - base:
            raise CorruptionError(
                f"{self.data_path}: data file ends inside transaction {transaction_id + k - 1}"
            )
        return raw, offsets[: k + 1]

    @overload
    def _read(
        self, transaction_id: int, max_count: int, max_bytes: int, headers: Literal[False]
    ) -> list[Record]: ...

    @overload
    def _read(
        self, transaction_id: int, max_count: int, max_bytes: int, headers: Literal[True]
    ) -> list[RecordHeader]: ...

    def _read(
        self, transaction_id: int, max_count: int, max_bytes: int, headers: bool
    ) -> list[Record] | list[RecordHeader]:
        raw, offsets = self._load(transaction_id, max_count, max_bytes)
        if not offsets:
            return []
        base = offsets[0]
        out_records: list[Record] = []
        out_headers: list[RecordHeader] = []
        for j in range(len(offsets) - 1):
            start = offsets[j] - base
            end = offsets[j + 1] - base
            txn = transaction_id + j
            rec = _decode_verified(raw, start, end, txn, self.data_path, offsets[j])
            if headers:
                out_headers.append(RecordHeader(rec[0], rec[1], rec[2]))
            else:
                out_records.append(
                    _tuple_new(Record, (rec[0], rec[1], rec[2], bytes(raw[start + 36 : end - 4]), rec[3]))
                )
        return out_headers if headers else out_records

    def read_record(self, transaction_id: int) -> Record | None:
        """The record, or None if this segment does not hold ``transaction_id``."""
        got = self._read(transaction_id, 1, DEFAULT_MAX_READ_BYTES, False)
        return got[0] if got else None

    def read_header(self, transaction_id: int) -> RecordHeader | None:
        got = self._read(transaction_id, 1, DEFAULT_MAX_READ_BYTES, True)
        return got[0] if got else None

    def read_records(
        self, transaction_id: int, max_count: int, *, max_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> list[Record]:
        """Consecutive records from ``transaction_id``: up to ``max_count`` (and ``max_bytes``, at least one),
        stopping at the end of the segment; empty if the segment does not hold ``transaction_id``."""
        return self._read(transaction_id, max_count, max_bytes, False)

    def read_headers(
        self, transaction_id: int, max_count: int, *, max_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> list[RecordHeader]:
        """Like :meth:`read_records` but only the headers (each record is still read and verified whole)."""
        return self._read(transaction_id, max_count, max_bytes, True)

    def read_run(
        self, transaction_id: int, max_count: int, *, max_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> tuple[int, bytes]:
        """Up to ``max_count`` consecutive records from ``transaction_id`` as stored (a record run, see
        :mod:`waltz.protocol.record_run`), at most ``max_bytes`` but at least one record: ``(count, bytes)``.

        One ``pread``; each record's checksum (which covers the whole record) is checked right after the read,
        so a damaged copy is refused here (RecordCorruptionError) and the server reads another replica,
        rather than relayed to a reader that could only fail. The reader still verifies both checksums of
        every record (end to end). ``(0, b"")`` if the segment does not hold ``transaction_id``.
        """
        raw, offsets = self._load(transaction_id, max_count, max_bytes)
        _check_run(raw, offsets, transaction_id, self.data_path)
        return max(len(offsets) - 1, 0), raw

    def read_wire(
        self, transaction_id: int, max_count: int, *, max_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> tuple[list[memoryview], list[int]]:
        """The records :meth:`read_run` returns, laid out as the storage protocol's record lists carry them
        (``Record``: the data checksum after the data, no record checksum): the pieces to join, three per
        record, and each record's wire length. Checked as :meth:`read_run` checks (id and record checksum,
        which covers the data and its checksum as written, and the data checksum was verified before the
        write), so a list read needs no Record object per record, and no second CRC of the data."""
        raw, offsets = self._load(transaction_id, max_count, max_bytes)
        _check_run(raw, offsets, transaction_id, self.data_path)
        if not offsets:
            return [], []
        view = memoryview(raw)
        base = offsets[0]
        parts: list[memoryview] = []
        for start, end in itertools.pairwise(offsets):
            s = start - base
            e = end - base
            parts += (
                view[s : s + _WIRE_PREFIX_BYTES],
                view[s + RECORD_HEADER_BYTES : e - 4],
                view[s + _WIRE_PREFIX_BYTES : s + RECORD_HEADER_BYTES],  # the data checksum
            )
        return parts, [b - a - 4 for a, b in itertools.pairwise(offsets)]

    def stored_record(self, transaction_id: int) -> tuple[int, bytes]:
        """``(offset, bytes)`` of a held record as stored, unverified (for repair and tools)."""
        raw, offsets = self._load(transaction_id, 1, 0)
        if not offsets:
            raise StorageError(f"{self.data_path}: transaction {transaction_id} is not in this segment")
        return offsets[0], raw

    def _adopt_unindexed_records(self) -> None:
        """Count, read-only, the records that verify in sequence after the index's last entry, their offsets
        kept in memory as a running node keeps them: the writable segment's index entries after its last
        checkpoint wait in the node's memory (a killed node never wrote them), so tools see what the node
        holds and its recovery keeps. A torn tail after them is left out, as recovery cuts it."""
        if self._count:
            start = self._verify_at(self.max_transaction_id, self._data_size)
            if start is None:
                return
        else:
            start = SEGMENT_HEADER_BYTES
        offsets, end = self._scan(self.next_transaction_id, start, self._data_size)
        if offsets:
            self._index_tail = bytearray(struct.pack(f">{len(offsets)}q", *offsets))
            self._count += len(offsets)
        if end != self._data_size:
            # Zeros at the end are free space the node preallocated, not part of the segment; torn bytes
            # before them still are (verify reports them, as it reports a torn tail without zeros).
            free = self._nonzero_end(end, self._data_size)
            self.zero_tail_bytes = self._data_size - free
            self._data_size = free
            if free != end:
                self._records_end = end

    def _nonzero_end(self, start: int, end: int) -> int:
        """The end of the last byte that is not zero in ``[start, end)`` of the data file, or ``start``: what
        follows it is zeros (free space, see :meth:`prefill`). Read backwards in chunks: a torn record before
        the zeros is found after reading the zeros once."""
        data_file, _ = self._files()
        pos = end
        while pos > start:
            lo = max(start, pos - SCAN_CHUNK_BYTES)
            kept = len(data_file.pread(pos - lo, lo).rstrip(b"\0"))
            if kept:
                return lo + kept
            pos = lo
        return start

    def record_offset(self, transaction_id: int) -> int:
        """Data-file offset of a held transaction (for tools)."""
        if self._range(transaction_id, 1) == 0:
            raise StorageError(f"{self.data_path}: transaction {transaction_id} is not in this segment")
        return self._offset_of(transaction_id - self.first_transaction_id)

    # ---------------------------------------------------------------------------------------- recovery

    def _recovery_plan(self, *, quiet: bool = False, local_low_water_mark: int = -1) -> _RecoveryPlan:
        """What recovery keeps, read-only: the restart point (the last checkpoint the index covers whose
        record verifies, else ``first - 1``), the offsets of the records after it (those that verify in
        sequence, and the durable ones that do not, kept as damaged: see :mod:`waltz.storage.resync`), the end
        of the last of them, and the damaged ids."""
        first = self.first_transaction_id
        index_max = first + self._count - 1
        data_size = self._data_size
        # Restart candidates, best first: the last checkpoints the index covers, then the header.
        candidates: list[int] = []
        c = (index_max // CHECKPOINT_INTERVAL) * CHECKPOINT_INTERVAL
        while c > first:
            candidates.append(c - 1)
            c -= CHECKPOINT_INTERVAL
        restart = first - 1
        scan_from = SEGMENT_HEADER_BYTES
        for r in candidates:
            end = self._verify_at(r, data_size)
            if end is not None:
                restart, scan_from = r, end
                break
            if not quiet:
                log.warning(
                    "%s: checkpoint record %d does not verify; trying an earlier one", self.data_path, r
                )
        new_offsets, end = self._scan(restart + 1, scan_from, data_size)
        damaged: list[tuple[int, list[int]]] = []
        durable_max = max(index_max, local_low_water_mark)
        txn = restart + 1 + len(new_offsets)
        zeroed: int | None = None
        while txn <= durable_max and end + RECORD_OVERHEAD_BYTES <= data_size:
            kept = self._keep_damage(txn, end, durable_max)
            if kept is None:
                # Only zeros from here: nothing to keep. Indexed records read as zeros were lost (a lost
                # write); below the local low-water mark alone the node finds the loss from its marks.
                zeroed = txn if txn <= index_max else None
                break
            offsets, end = kept
            damaged.append((txn, [*offsets, end]))
            txn += len(offsets)
            more, end = self._scan(txn, end, data_size)
            new_offsets += offsets
            new_offsets += more
            txn += len(more)
        return _RecoveryPlan(restart, new_offsets, end, damaged, zeroed)

    def _note_unverified(self, first_id: int, bounds: list[int]) -> None:
        """Add to :attr:`damaged_at_open` the ids of a kept region whose records do not verify where the
        region's offsets (``bounds``: each record's start, then the region's end) put them."""
        data_file, _ = self._files()
        for i, (start, stop) in enumerate(itertools.pairwise(bounds)):
            if len(self.damaged_at_open) >= MAX_DAMAGED_AT_OPEN:
                return
            if record_end(data_file, start, first_id + i, stop, self.data_path, _verify_whole) != stop:
                self.damaged_at_open.append(first_id + i)

    def _keep_damage(self, txn: int, offset: int, durable_max: int) -> tuple[list[int], int] | None:
        """The offsets of the durable records from ``txn`` (at ``offset``, not verifying) up to the next
        record that verifies, and where that one begins; or, when none does, of the damaged records up to
        the last byte that is not zero and where they end. None when only zeros follow."""
        data_file, _ = self._files()
        first = self.first_transaction_id
        data_size = self._data_size
        verify = _verify_whole
        found = find_next_good(
            data_file, self._index_entries, first, self._count, txn, offset, data_size, self.data_path, verify
        )
        if found is not None:
            nxt, limit = found
            ids = range(txn, nxt)
        else:
            limit = self._nonzero_end(offset, data_size)
            if limit == offset:
                return None
            room = max(1, (limit - offset) // RECORD_OVERHEAD_BYTES)
            ids = range(txn, min(durable_max, txn + room - 1) + 1)
        in_index = ids.stop - first <= self._count
        offsets = damaged_extents(
            data_file, self._index_entries if in_index else _no_entries, first, ids, offset, limit
        )
        end = limit if found is not None else last_end(data_file, offsets[-1], limit)
        return offsets, end

    def recovered_max_transaction_id(self) -> int:
        """The max id the node's index recovery will keep, read-only (for tools on a stopped node: the index
        of one killed may end before its records, or past them part-way through a truncate)."""
        plan = self._recovery_plan(quiet=True)
        return plan.restart + len(plan.offsets)

    def _recover(self, local_low_water_mark: int) -> None:
        data_file, index_file = self._files()
        first = self.first_transaction_id
        index_max = first + self._count - 1
        data_size = self._data_size
        restart, new_offsets, end, damaged, zeroed = self._recovery_plan(
            local_low_water_mark=local_low_water_mark
        )
        if zeroed is not None:
            self.lost_at_open = (
                f"{self.data_path}: transactions {zeroed}..{index_max} were durable (their index entries "
                "were written after an fsync) but read as zeros: lost"
            )
            log.error("%s; the log ends at %d", self.lost_at_open, zeroed - 1)
        last = restart + len(new_offsets)
        keep = last - first + 1
        for region_first, bounds in damaged:
            log.error(
                "%s: transaction(s) %d..%d do not verify but were durable (%s); kept as damaged records, "
                "not cut: the node reports them and repairs them from another replica",
                self.data_path,
                region_first,
                region_first + len(bounds) - 2,
                "their index entries were written after an fsync"
                if region_first <= index_max
                else f"at or below the local low-water mark {local_low_water_mark}",
            )
            self._note_unverified(region_first, bounds)
        if end != data_size:
            torn_end = self._nonzero_end(end, data_size)
            if torn_end != end:
                log.warning(
                    "%s: cut %d bytes after transaction %d (partial or unverified tail)%s",
                    self.data_path,
                    torn_end - end,
                    last,
                    f", and {data_size - torn_end} bytes of preallocated zeros after them"
                    if torn_end != data_size
                    else "",
                )
            else:
                # Free space, not damage: the zeros are written again ahead of the next appends.
                log.debug("%s: cut %d bytes of preallocated zeros", self.data_path, data_size - end)
        if last < min(local_low_water_mark, index_max):
            log.warning(
                "%s: recovery cut the log at %d, below the local low-water mark %d",
                self.data_path,
                last,
                local_low_water_mark,
            )
        # The data file first, durably: an index entry on disk must only ever name a durable record (see
        # waltz.storage.resync), and what we read may have come from an unsynced page cache.
        data_file.truncate(end)
        data_file.fsync()
        if new_offsets:
            index_file.pwrite(
                struct.pack(f">{len(new_offsets)}q", *new_offsets),
                SEGMENT_HEADER_BYTES + INDEX_ENTRY_BYTES * (restart + 1 - first),
            )
        index_file.truncate(SEGMENT_HEADER_BYTES + INDEX_ENTRY_BYTES * keep)
        index_file.fsync()
        self._count = self._flushed_count = keep
        self._data_size = self._zeros_durable_end = end
        self._data_dirty = self._index_dirty = False

    def _verify_at(self, transaction_id: int, data_size: int) -> int | None:
        """End offset of ``transaction_id``'s record if its index entry points at a record that verifies."""
        data_file, _ = self._files()
        try:
            offset = self._offset_of(transaction_id - self.first_transaction_id)
        except CorruptionError:
            return None
        if offset < SEGMENT_HEADER_BYTES or offset + RECORD_OVERHEAD_BYTES > data_size:
            return None
        prefix = data_file.pread(RECORD_HEADER_BYTES, offset)
        n: int = _PREFIX.unpack(prefix)[4]
        if n < 0 or offset + RECORD_OVERHEAD_BYTES + n > data_size:
            return None
        raw = data_file.pread(RECORD_OVERHEAD_BYTES + n, offset)
        try:
            _decode_verified(raw, 0, len(raw), transaction_id, self.data_path, offset)
        except CorruptionError:
            return None
        return offset + RECORD_OVERHEAD_BYTES + n

    def _scan(self, transaction_id: int, offset: int, data_size: int) -> tuple[list[int], int]:
        """Offsets of the records from ``offset`` that verify in sequence from ``transaction_id``, and the end
        offset of the last of them."""
        data_file, _ = self._files()
        offsets: list[int] = []
        expected = transaction_id
        buf = b""
        buf_start = offset
        pos = offset
        while pos + RECORD_OVERHEAD_BYTES <= data_size:
            rel = pos - buf_start
            if rel + RECORD_HEADER_BYTES > len(buf):
                buf, buf_start, rel = data_file.pread(SCAN_CHUNK_BYTES, pos), pos, 0
            n = _PREFIX.unpack_from(buf, rel)[4]
            rec_len = RECORD_OVERHEAD_BYTES + n
            if n < 0 or pos + rec_len > data_size:
                break
            if rel + rec_len > len(buf):
                buf, buf_start, rel = data_file.pread(max(SCAN_CHUNK_BYTES, rec_len), pos), pos, 0
            try:
                _decode_verified(buf, rel, rel + rec_len, expected, self.data_path, pos)
            except CorruptionError:
                break
            offsets.append(pos)
            pos += rec_len
            expected += 1
        return offsets, pos

    def verify(self, transaction_id: int | None = None) -> list[str]:
        """Check index offsets and record checksums (of one transaction or all); return the problems found."""
        data_file, _ = self._files()
        problems: list[str] = []
        first = self.first_transaction_id
        if transaction_id is not None:
            if self._range(transaction_id, 1) == 0:
                return [
                    f"transaction {transaction_id} is not in this segment "
                    f"({first}..{self.max_transaction_id})"
                ]
            ids = range(transaction_id, transaction_id + 1)
        else:
            ids = range(first, self.max_transaction_id + 1)
        chunk = 4096
        expected_offset = SEGMENT_HEADER_BYTES if transaction_id is None else None
        for lo in range(ids.start, ids.stop, chunk):
            hi = min(ids.stop, lo + chunk)
            raw = self._index_entries(lo - first, hi - lo)
            for txn in range(lo, hi):
                j = (txn - lo) * INDEX_ENTRY_BYTES
                if j + INDEX_ENTRY_BYTES > len(raw):
                    problems.append(f"transaction {txn}: index entry missing")
                    return problems
                offset = _I64.unpack_from(raw, j)[0]
                if expected_offset is not None and offset != expected_offset:
                    problems.append(f"transaction {txn}: index offset {offset}, expected {expected_offset}")
                if offset < SEGMENT_HEADER_BYTES or offset + RECORD_OVERHEAD_BYTES > self._data_size:
                    problems.append(f"transaction {txn}: index offset {offset} outside the data file")
                    expected_offset = None
                    continue
                n = _PREFIX.unpack(data_file.pread(RECORD_HEADER_BYTES, offset))[4]
                if n < 0 or offset + RECORD_OVERHEAD_BYTES + n > self._data_size:
                    problems.append(
                        f"transaction {txn}: record at {offset} runs past the end of the data file"
                    )
                    expected_offset = None
                    continue
                rec = data_file.pread(RECORD_OVERHEAD_BYTES + n, offset)
                try:
                    _decode_verified(rec, 0, len(rec), txn, self.data_path, offset)
                except CorruptionError as e:
                    problems.append(str(e))
                expected_offset = offset + RECORD_OVERHEAD_BYTES + n
        if transaction_id is None and expected_offset is not None and expected_offset != self._data_size:
            problems.append(f"{self._data_size - expected_offset} bytes after the last indexed record")
        return problems

    def delete_files(self, fs: FileSystem) -> None:
        """Close and remove both files (data first, so a crash leaves at worst an orphan index)."""
        if not self.closed:
            data, index = self._files()
            self._data = self._index = None
            data.close()
            index.close()
        fs.remove(self.data_path)
        fs.remove(self.index_path)
        fs.fsync_dir(self.directory)


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


class _RecoveryPlan(NamedTuple):
    restart: int
    offsets: list[int]
    end: int
    damaged: list[tuple[int, list[int]]]
    """The regions kept after a durable record that does not verify: ``(first id, offsets)``, the offsets
    of each record then the region's end."""
    zeroed: int | None
    """The first of the durable (indexed) records found to read as zeros up to the end, or None."""


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
