"""The open segment's files, reads, writes and zero prefill: :class:`SegmentIO`, the base of
:class:`waltz.storage.segment.Segment` (which adds creating, opening and recovery).

The on-disk format is documented byte by byte in :mod:`waltz.storage.segment_format`.
"""

from __future__ import annotations

import bisect
import itertools
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, overload

from waltz.errors import CorruptionError, StorageError
from waltz.protocol.records import Record, RecordHeader
from waltz.storage.fileio import File, FileSystem
from waltz.storage.segment_format import (
    _I64,
    _WIRE_PREFIX_BYTES,
    _ZEROS,
    CHECKPOINT_INTERVAL,
    DEFAULT_MAX_READ_BYTES,
    INDEX_ENTRY_BYTES,
    MAX_READ_RECORDS,
    PREFILL_CHUNK_BYTES,
    RECORD_HEADER_BYTES,
    SEGMENT_HEADER_BYTES,
    SegmentHeader,
    _check_run,
    _decode_verified,
    data_file_name,
    encode_stored_run,
    index_file_name,
    verify_client_checksums,
)

_tuple_new = tuple.__new__  # builds Records without the generated __new__ on the read hot path


@dataclass
class ZeroFill:
    """Zeros :meth:`Segment.prefill` wrote past the last record, not yet durable: :meth:`sync` them (in any
    thread: it uses a descriptor of its own), then call :meth:`done` where the segment is used."""

    segment: SegmentIO
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


class SegmentIO:
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
        self._prefill_idle_below = 0
        self._prefill_idle_ahead = 0
        """:meth:`prefill` with ``ahead_bytes`` ``_prefill_idle_ahead`` has nothing to write while the last
        record ends below ``_prefill_idle_below`` (the file only grows meanwhile; a cut resets it): the
        answer without asking the file's size, after every group."""
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
            raise self._closed_error()
        return self._data, self._index

    def _closed_error(self) -> StorageError:
        # (The append path reads _data and _index with this check of its own: no _files() call per append.)
        return StorageError(f"{self.data_path}: segment is closed")

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
        data_file = self._data
        if data_file is None:
            raise self._closed_error()
        if not self.writable:
            raise StorageError(f"{self.data_path}: segment is read-only")
        threshold = size_threshold_bytes if size_threshold_bytes is not None else 1 << 62
        i = start
        total = len(ends)
        whole = len(run)
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
            end = ends[j - 1]
            # The whole run (the usual case) as it is: a memoryview costs more than a small write's syscall.
            data_file.pwrite(run if run_base == 0 and end == whole else memoryview(run)[run_base:end], base)
            if base + end - run_base > self._zeros_durable_end:
                self.extending_writes += 1
            # The index entries wait in memory (see _index_tail) until the fsync that makes their records
            # durable (write_flushed_index) or the next checkpoint: one index write per group.
            self._index_tail += struct.pack(
                f">{j - i}q", base, *map((base - run_base).__add__, ends[i : j - 1])
            )
            self._data_size = base + end - run_base
            self._count += j - i
            self._data_dirty = True
            i = j
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
        data_file = self._data
        if data_file is None:
            raise self._closed_error()
        if not self.writable:
            raise StorageError(f"{self.data_path}: segment is read-only")
        if self._data_size < self._prefill_idle_below and ahead_bytes == self._prefill_idle_ahead:
            return None
        # Half the distance at most, so the next chunk is written while the other half is still ahead.
        chunk = min(PREFILL_CHUNK_BYTES, ahead_bytes // 2)
        size = data_file.size()
        if chunk <= 0:
            return None
        if size - self._data_size > ahead_bytes - chunk:
            self._prefill_idle_below = size - ahead_bytes + chunk
            self._prefill_idle_ahead = ahead_bytes
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
            self._prefill_idle_below = 0
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
        data_file = self._data
        if data_file is None:
            raise self._closed_error()
        covered = self._count
        if self._data_dirty:
            data_file.fsync(data_only=True)
            self._data_dirty = False
        self._flushed_count = covered

    def flush_begin(self) -> Callable[[], None]:
        """:meth:`flush` in two halves around one ``syncfs`` of the whole file system (instead of this data
        file's fsync), called before it starts: returns what to call once it returned 0, which records what
        it made durable (the records appended so far). As for :meth:`flush`, nothing is appended meanwhile."""
        self._files()
        covered = self._count

        def synced() -> None:
            self._data_dirty = False
            self._flushed_count = covered

        return synced

    def write_flushed_index(self) -> None:
        """Write the index entries waiting in memory of the records the last :meth:`flush` made durable, not
        fsynced: one ``pwrite`` that lets recovery after a process kill know those records were durable (and
        so keep one that does not verify as damage, not cut it as a torn tail: see waltz.storage.resync)."""
        tail = self._index_tail
        written = self._count - len(tail) // INDEX_ENTRY_BYTES
        n = min(len(tail) // INDEX_ENTRY_BYTES, self._flushed_count - written)
        if n <= 0:
            return
        index_file = self._index  # (both files close together)
        if index_file is None:
            raise self._closed_error()
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
        self._prefill_idle_below = 0
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

    def record_offset(self, transaction_id: int) -> int:
        """Data-file offset of a held transaction (for tools)."""
        if self._range(transaction_id, 1) == 0:
            raise StorageError(f"{self.data_path}: transaction {transaction_id} is not in this segment")
        return self._offset_of(transaction_id - self.first_transaction_id)

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
