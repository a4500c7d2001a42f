"""One segment of a partition's log: a data file ``%019d.seg`` and an index file ``%019d.idx``.

:class:`Segment` creates, opens and recovers one; its reads and writes are in
:mod:`waltz.storage.segment_io`, its on-disk format (documented byte by byte) and record codec in
:mod:`waltz.storage.segment_format`. Every name callers use is importable from here.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

from waltz.errors import CorruptionError, StorageError
from waltz.storage.fileio import OS_FS, File, FileSystem
from waltz.storage.resync import damaged_extents, find_next_good, last_end, record_end
from waltz.storage.segment_format import (
    _I64,
    _PREFIX,
    CHECKPOINT_INTERVAL,
    DEFAULT_MAX_READ_BYTES,
    FORMAT_VERSION,
    INDEX_ENTRY_BYTES,
    MAX_DAMAGED_AT_OPEN,
    MAX_READ_RECORDS,
    MAX_RECORD_DATA_BYTES,
    PREFILL_CHUNK_BYTES,
    RECORD_HEADER_BYTES,
    RECORD_OVERHEAD_BYTES,
    SCAN_CHUNK_BYTES,
    SEGMENT_HEADER_BYTES,
    RecordCorruptionError,
    SegmentHeader,
    _check_header,
    _decode_verified,
    _no_entries,
    _verify_whole,
    append_wire_run,
    data_file_name,
    encode_record,
    encode_stored_run,
    index_file_name,
    parse_segment_name,
    verify_client_checksums,
)
from waltz.storage.segment_io import SegmentIO, ZeroFill

__all__ = [
    "CHECKPOINT_INTERVAL",
    "DEFAULT_MAX_READ_BYTES",
    "FORMAT_VERSION",
    "INDEX_ENTRY_BYTES",
    "MAX_DAMAGED_AT_OPEN",
    "MAX_READ_RECORDS",
    "MAX_RECORD_DATA_BYTES",
    "PREFILL_CHUNK_BYTES",
    "RECORD_HEADER_BYTES",
    "RECORD_OVERHEAD_BYTES",
    "RecordCorruptionError",
    "SCAN_CHUNK_BYTES",
    "SEGMENT_HEADER_BYTES",
    "Segment",
    "SegmentHeader",
    "SegmentIO",
    "ZeroFill",
    "append_wire_run",
    "data_file_name",
    "encode_record",
    "encode_stored_run",
    "index_file_name",
    "parse_segment_name",
    "verify_client_checksums",
]

log = logging.getLogger(__name__)


class Segment(SegmentIO):
    """One open segment. Not thread-safe: its partition's single owner calls it.

    A writable segment accepts appends and truncation; a read-only one only reads. Reads verify every record
    checksum right after reading and raise CorruptionError on a mismatch.
    """

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
        self._prefill_idle_below = 0
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


class _RecoveryPlan(NamedTuple):
    restart: int
    offsets: list[int]
    end: int
    damaged: list[tuple[int, list[int]]]
    """The regions kept after a durable record that does not verify: ``(first id, offsets)``, the offsets
    of each record then the region's end."""
    zeroed: int | None
    """The first of the durable (indexed) records found to read as zeros up to the end, or None."""
