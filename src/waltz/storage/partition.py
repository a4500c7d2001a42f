"""The log of one partition on a storage node: every segment in ``<storage directory>/<partition id>/``.

Segments are named after their first transaction id (see :mod:`waltz.storage.segment` for the byte layout)
and hold consecutive ranges: segment ``k+1`` starts at the max id of segment ``k`` plus one. Only the last
segment is writable; it is recovered (index recovery) when the partition opens. Older segments are read-only,
opened lazily on a read and kept in a bounded LRU cache (``segment_cache_capacity``) that closes the files of
evicted segments.

Durability: :meth:`PartitionLog.append` does not fsync (except at a 1000-id checkpoint or a rollover);
:meth:`PartitionLog.flush` fsyncs the data file and must be called before an append is acknowledged. The node
calls it once per group of batches (group commit). :meth:`PartitionLog.truncate` is durable when it returns.

Rollover: once the writable segment's data file passes ``segment_size_threshold_bytes`` (possibly in the
middle of a batch), it is fsynced and closed, and the next record opens a new segment whose first id is that
record's id.

Preallocation: :meth:`PartitionLog.prefill` keeps the writable segment's data file zero-filled ahead of its
last record (see :meth:`waltz.storage.segment.Segment.prefill`); sizes here are logical (the end of the last
record), so the zeros change neither the roll-over point nor what is read.

List reads (:meth:`PartitionLog.read_records`, :meth:`PartitionLog.read_headers`) continue across segment
boundaries until ``max_count`` items, ``max_bytes`` of records or the end of the log, whichever comes first.

Crash leftovers handled at open: an index file without its data file (a deletion cut short) is removed; a last
segment whose data file holds no record and whose header or index is missing or unreadable (a creation cut
short) is removed. Anything else that does not verify raises CorruptionError.

Everything here is synchronous and not thread-safe: the node runs each partition from its own task, and every
call does a bounded amount of work.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence

from waltz.errors import (
    CorruptionError,
    FormatVersionError,
    StorageError,
    TransactionOutOfOrderError,
    WaltzError,
)
from waltz.protocol.record_run import encode_run
from waltz.protocol.records import Record, RecordHeader
from waltz.protocol.storage import WireRecordList
from waltz.storage.fileio import OS_FS, FileSystem, make_dirs_durable
from waltz.storage.retention import DetachedSegments, delete_detached
from waltz.storage.segment import (
    DEFAULT_MAX_READ_BYTES,
    MAX_READ_RECORDS,
    SEGMENT_HEADER_BYTES,
    Segment,
    SegmentHeader,
    ZeroFill,
    data_file_name,
    encode_stored_run,
    index_file_name,
    parse_segment_name,
    verify_client_checksums,
)

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_SIZE_THRESHOLD_BYTES = 1_000_000_000
DEFAULT_SEGMENT_CACHE_CAPACITY = 5
MIN_SEGMENT_SIZE_THRESHOLD_BYTES = SEGMENT_HEADER_BYTES


class PartitionLog:
    """All segments of one partition. Use :meth:`open`; call :meth:`close` when done."""

    def __init__(
        self,
        fs: FileSystem,
        directory: str,
        key: uuid.UUID,
        partition_id: int,
        first_ids: list[int],
        current: Segment,
        segment_size_threshold_bytes: int,
        segment_cache_capacity: int,
        clock_ms: Callable[[], int],
    ) -> None:
        self._fs = fs
        self.directory = directory
        self.key = key
        self.partition_id = partition_id
        self._first_ids = first_ids
        self._current: Segment | None = current
        self.segment_size_threshold_bytes = segment_size_threshold_bytes
        self.segment_cache_capacity = segment_cache_capacity
        self._cache: OrderedDict[int, Segment] = OrderedDict()
        self._clock_ms = clock_ms
        self._extending_writes_before = 0
        """``extending_writes`` of the segments that were writable before the current one."""
        self._index_write_failure_log_s = -1e9
        self._closed_bytes: dict[int, int] = {}
        """First id -> bytes of a closed segment's files (they do not change), for :meth:`segment_sizes`."""
        self.damaged_at_open: list[int] = []
        """Ids recovery found durable but not verifying and kept as damaged records (not cut): the caller
        reports them (see :mod:`waltz.storage.resync`)."""
        self.lost_at_open: str | None = None
        """Why recovery found durable records lost (see :attr:`Segment.lost_at_open`), or None."""

    @classmethod
    def open(
        cls,
        storage_directory: str,
        key: uuid.UUID,
        partition_id: int,
        *,
        fs: FileSystem = OS_FS,
        segment_size_threshold_bytes: int = DEFAULT_SEGMENT_SIZE_THRESHOLD_BYTES,
        segment_cache_capacity: int = DEFAULT_SEGMENT_CACHE_CAPACITY,
        local_low_water_mark: int = -1,
        trim_point: int = 0,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> PartitionLog:
        """Open (creating if new) the partition's directory and recover its last segment. Segments wholly
        below ``trim_point`` (the replica's, see :mod:`waltz.storage.retention`) that a crash kept from being
        deleted are deleted now, before the segments are checked to follow each other."""
        if segment_size_threshold_bytes < MIN_SEGMENT_SIZE_THRESHOLD_BYTES:
            raise StorageError(
                f"segment_size_threshold_bytes must be at least {MIN_SEGMENT_SIZE_THRESHOLD_BYTES}, "
                f"got {segment_size_threshold_bytes}"
            )
        if segment_cache_capacity < 1:
            raise StorageError(f"segment_cache_capacity must be at least 1, got {segment_cache_capacity}")
        directory = os.path.join(storage_directory, str(partition_id))
        # The partition directory's entry is durable (an fsync of the storage directory) before anything is
        # written into it: segments fsynced inside a directory a power cut drops are lost with it.
        make_dirs_durable(fs, directory)
        first_ids, idxs = _list_segments(fs, directory)
        current, first_ids = _open_newest_segment(
            fs, directory, key, partition_id, first_ids, idxs, local_low_water_mark, clock_ms
        )
        damaged = list(current.damaged_at_open)
        lost = current.lost_at_open
        part = cls(
            fs,
            directory,
            key,
            partition_id,
            first_ids,
            current,
            segment_size_threshold_bytes,
            segment_cache_capacity,
            clock_ms,
        )
        part.damaged_at_open = damaged
        part.lost_at_open = lost
        try:
            if trim_point > 0:
                below = part.detach_below(trim_point)
                if below is not None:
                    delete_detached(fs, below)
                    log.info(
                        "%s: deleted %d segment(s) below the trim point %d",
                        directory,
                        len(below.first_ids),
                        trim_point,
                    )
            if len(first_ids) > 1:
                # The segment before the last must end right where the last begins.
                part._segment_at(len(first_ids) - 2)
        except BaseException:
            part.close()
            raise
        return part

    # ------------------------------------------------------------------------------------------- state

    # The append path (max_transaction_id, append_run, flush, prefill) reads _current with its own None
    # check: a call of _writable() there was a fifth of the node's per-append calls.
    def _writable(self) -> Segment:
        if self._current is None:
            raise self._closed_error()
        return self._current

    def _closed_error(self) -> StorageError:
        return StorageError(f"{self.directory}: partition log is closed")

    @property
    def max_transaction_id(self) -> int:
        """The highest transaction id stored (durable or not); -1 when the log is empty."""
        current = self._current
        if current is None:
            raise self._closed_error()
        return current.max_transaction_id

    @property
    def segment_first_ids(self) -> list[int]:
        """First transaction ids of all segments, oldest first (a copy)."""
        return list(self._first_ids)

    def segment_sizes(self, max_segments: int) -> list[tuple[int, int]]:
        """``(first transaction id, bytes of its data and index files)`` of the newest ``max_segments``
        segments, oldest first (for a retention policy in bytes). A closed segment's files are measured once;
        the writable one's each time."""
        current = self._writable().first_transaction_id
        held = set(self._first_ids)
        self._closed_bytes = {f: b for f, b in self._closed_bytes.items() if f in held and f != current}
        out: list[tuple[int, int]] = []
        for first in self._first_ids[-max_segments:] if max_segments > 0 else []:
            size = self._closed_bytes.get(first)
            if size is None:
                size = self._files_bytes(first)
                if first != current:
                    self._closed_bytes[first] = size
            out.append((first, size))
        return out

    def _files_bytes(self, first_id: int) -> int:
        total = 0
        for name in (data_file_name(first_id), index_file_name(first_id)):
            path = os.path.join(self.directory, name)
            if not self._fs.exists(path):
                continue
            f = self._fs.open(path, read_only=True)
            try:
                total += f.size()
            finally:
                f.close()
        return total

    @property
    def cached_segment_count(self) -> int:
        return len(self._cache)

    # ------------------------------------------------------------------------------------------ writes

    def append(self, records: Sequence[Record]) -> None:
        """Append records whose ids continue the log densely from :attr:`max_transaction_id` + 1.

        The whole batch is checked (ids, client checksums) before anything is written. Not durable until
        :meth:`flush` returns.
        """
        if not records:
            return
        expected = self._writable().next_transaction_id
        if records[0].transaction_id != expected:
            raise TransactionOutOfOrderError(
                f"partition {self.partition_id}: transaction out of order: expected {expected}, "
                f"got {records[0].transaction_id}"
            )
        verify_client_checksums(records, expected)
        run, ends = encode_stored_run(records)
        self.append_run(run, ends, expected)

    def append_run(self, run: bytes | bytearray, ends: Sequence[int], first_transaction_id: int) -> None:
        """Append a stored run of records ``first_transaction_id..`` that continues the log, already checked
        record by record (:func:`~waltz.storage.segment.append_wire_run`); ``ends[k]`` is where record ``k``
        ends in ``run``. Not durable until :meth:`flush` returns."""
        if not ends:
            return
        current = self._current
        if current is None:
            raise self._closed_error()
        expected = current.next_transaction_id
        if first_transaction_id != expected:
            raise TransactionOutOfOrderError(
                f"partition {self.partition_id}: transaction out of order: expected {expected}, "
                f"got {first_transaction_id}"
            )
        threshold = self.segment_size_threshold_bytes
        # The segment writes until a record takes it past the threshold (at once, if it is past it already):
        # then the rest goes to a new one.
        i = current.append_run(run, ends, 0, size_threshold_bytes=threshold)
        total = len(ends)
        while i < total:
            current = self._roll_over()
            i += current.append_run(run, ends, i, size_threshold_bytes=threshold)

    def _roll_over(self) -> Segment:
        old = self._writable()
        next_id = old.next_transaction_id
        # The full segment becomes durable (data and index) before its successor exists, so recovery only
        # ever has to repair the last segment.
        old.close()
        self._extending_writes_before += old.extending_writes
        self._current = None
        new = Segment.create(
            self._fs, self.directory, self.key, self.partition_id, next_id, clock_ms=self._clock_ms
        )
        self._first_ids.append(next_id)
        self._current = new
        log.debug("%s: rolled over to a new segment at %d", self.directory, next_id)
        return new

    def flush(self) -> None:
        """Make every appended record durable (fsync of the writable segment's data file)."""
        current = self._current
        if current is None:
            raise self._closed_error()
        current.flush()

    def flush_begin(self) -> Callable[[], None]:
        """:meth:`flush` around a ``syncfs`` that covers the writable segment's data file: call before it
        starts; call what it returns once it returned 0 (see :meth:`Segment.flush_begin`)."""
        return self._writable().flush_begin()

    def write_flushed_index(self) -> None:
        """After :meth:`flush`, on the thread that appends: write the index entries of the records it made
        durable (not fsynced; see :meth:`Segment.write_flushed_index`). A failure is logged (at most once per
        10 s) and changes nothing: the entries wait for the next checkpoint, as they did before."""
        try:
            self._writable().write_flushed_index()
        except (WaltzError, OSError) as e:
            now = time.monotonic()
            if now - self._index_write_failure_log_s >= 10:
                self._index_write_failure_log_s = now
                log.warning("%s: could not write the index entries of flushed records: %s", self.directory, e)

    def prefill(self, ahead_bytes: int) -> ZeroFill | None:
        """Write the next chunk of zeros ahead of the writable segment's last record, if one is missing (not
        past the roll-over threshold); the next :meth:`flush` makes the returned zeros durable. See
        :meth:`Segment.prefill`."""
        current = self._current
        if current is None:
            raise self._closed_error()
        # Past the threshold (the next append rolls over) it writes nothing: no zeros go past the threshold.
        return current.prefill(ahead_bytes, self.segment_size_threshold_bytes)

    @property
    def extending_writes(self) -> int:
        """Data-file writes of this log that reached past the fsynced zeros (every write when nothing is
        preallocated): see :attr:`Segment.extending_writes`."""
        current = self._current
        return self._extending_writes_before + (current.extending_writes if current is not None else 0)

    @property
    def prefilled_bytes(self) -> int:
        """Fsynced zeros after the writable segment's last record (see :attr:`Segment.prefilled_bytes`)."""
        return self._writable().prefilled_bytes

    def truncate(self, transaction_id: int) -> int:
        """Keep only the records ``<= transaction_id``; durable on return. Returns the new max id."""
        current = self._writable()
        if transaction_id < -1:
            raise StorageError(f"cannot truncate to {transaction_id}")
        if transaction_id >= current.max_transaction_id:
            return current.max_transaction_id
        # Newest first, so that a crash part-way leaves a consistent, shorter set of whole segments.
        while len(self._first_ids) > 1 and self._first_ids[-1] > transaction_id + 1:
            first = self._first_ids[-1]
            seg = (
                self._current
                if self._current is not None and self._current.first_transaction_id == first
                else None
            )
            if seg is None:
                seg = self._cache.pop(first, None)
            if seg is not None:
                seg.delete_files(self._fs)
            else:
                self._fs.remove(os.path.join(self.directory, data_file_name(first)))
                self._fs.remove(os.path.join(self.directory, index_file_name(first)))
                self._fs.fsync_dir(self.directory)
            if seg is not None and self._current is seg:
                self._extending_writes_before += seg.extending_writes
                self._current = None
            self._first_ids.pop()
        last_first = self._first_ids[-1]
        if self._current is None or self._current.first_transaction_id != last_first:
            cached = self._cache.pop(last_first, None)
            if cached is not None:
                cached.close()
            self._current = Segment.open(
                self._fs,
                self.directory,
                last_first,
                key=self.key,
                partition_id=self.partition_id,
                writable=True,
            )
        self._current.truncate(max(transaction_id, last_first - 1))
        return self._current.max_transaction_id

    def detach_below(self, trim_point: int) -> DetachedSegments | None:
        """Take the segments wholly below ``trim_point`` out of the log (closing their cached files) and say
        which they were; None if there are none. Never the writable segment. Their files are deleted by the
        caller, off this task (:func:`waltz.storage.retention.delete_detached`)."""
        current = self._writable()
        n = 0
        while n + 1 < len(self._first_ids) and self._first_ids[n + 1] <= trim_point:
            n += 1
        if n == 0:
            return None
        firsts = self._first_ids[:n]
        assert current.first_transaction_id not in firsts
        for first in firsts:
            seg = self._cache.pop(first, None)
            if seg is not None:
                seg.close()
        del self._first_ids[:n]
        return DetachedSegments(self.directory, tuple(firsts), self._first_ids[0])

    def restart_at(self, first_id: int) -> DetachedSegments:
        """Make the log start empty at ``first_id`` (above everything it holds): a new segment there becomes
        the writable one, durably, and every older segment is detached for deletion. For a replica that
        lags below the partition's trim point: what it lacks was trimmed everywhere, so it need not hold it.
        A crash before the old segments are deleted leaves them below the trim point, which :meth:`open`
        deletes."""
        current = self._writable()
        if first_id <= current.max_transaction_id + 1:
            raise StorageError(f"{self.directory}: cannot restart at {first_id}, the log holds up to it")
        new = Segment.create(
            self._fs, self.directory, self.key, self.partition_id, first_id, clock_ms=self._clock_ms
        )
        self._extending_writes_before += current.extending_writes
        current.close()
        for seg in self._cache.values():
            seg.close()
        self._cache.clear()
        old, self._first_ids, self._current = self._first_ids, [first_id], new
        return DetachedSegments(self.directory, tuple(old), first_id)

    # ------------------------------------------------------------------------------------------- reads

    def _segment_index(self, transaction_id: int) -> int:
        return bisect.bisect_right(self._first_ids, transaction_id) - 1

    def _segment_at(self, i: int) -> Segment:
        first = self._first_ids[i]
        current = self._writable()
        if first == current.first_transaction_id:
            return current
        seg = self._cache.get(first)
        if seg is not None:
            self._cache.move_to_end(first)
            return seg
        seg = Segment.open(self._fs, self.directory, first, key=self.key, partition_id=self.partition_id)
        expected_max = self._first_ids[i + 1] - 1
        if seg.max_transaction_id != expected_max:
            seg.close()
            raise CorruptionError(
                f"{seg.index_path}: index ends at transaction {seg.max_transaction_id}, "
                f"the next segment starts at {expected_max + 1}"
            )
        self._cache[first] = seg
        while len(self._cache) > self.segment_cache_capacity:
            _, evicted = self._cache.popitem(last=False)
            evicted.close()
        return seg

    def segment_for(self, transaction_id: int) -> Segment | None:
        """The segment holding ``transaction_id``, or None if no segment does."""
        if transaction_id < 0 or transaction_id > self.max_transaction_id:
            return None
        i = self._segment_index(transaction_id)
        return self._segment_at(i) if i >= 0 else None

    def read_record(self, transaction_id: int) -> Record | None:
        """The record, verified; None if ``transaction_id`` is not in the log."""
        seg = self.segment_for(transaction_id)
        return seg.read_record(transaction_id) if seg is not None else None

    def read_header(self, transaction_id: int) -> RecordHeader | None:
        seg = self.segment_for(transaction_id)
        return seg.read_header(transaction_id) if seg is not None else None

    def read_records(
        self, transaction_id: int, max_count: int, *, max_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> list[Record]:
        """Consecutive verified records from ``transaction_id``, across segments; empty if not in the log."""
        out: list[Record] = []
        budget = max_bytes
        count = min(max_count, MAX_READ_RECORDS)
        txn = transaction_id
        while len(out) < count and budget > 0:
            seg = self.segment_for(txn)
            if seg is None:
                break
            got = seg.read_records(txn, count - len(out), max_bytes=budget)
            if not got:
                break
            out.extend(got)
            budget -= sum(len(r.data) + 40 for r in got)
            txn += len(got)
        return out

    def read_wire(
        self, transaction_id: int, max_count: int, *, max_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> WireRecordList:
        """:meth:`read_records`, across segments and with the same bounds, kept in the storage protocol's wire
        layout (:meth:`Segment.read_wire`): what a RecordListRequest is answered with, without a Record per
        record."""
        parts: list[memoryview] = []
        lengths: list[int] = []
        budget = max_bytes
        count = min(max_count, MAX_READ_RECORDS)
        txn = transaction_id
        while len(lengths) < count and budget > 0:
            seg = self.segment_for(txn)
            if seg is None:
                break
            got_parts, got = seg.read_wire(txn, count - len(lengths), max_bytes=budget)
            if not got:
                break
            parts += got_parts
            lengths += got
            budget -= sum(got) + 4 * len(got)  # stored bytes, as read_records counts them
            txn += len(got)
        starts = [0]
        starts += itertools.accumulate(lengths)
        return WireRecordList(b"".join(parts), starts)

    def read_run(
        self, transaction_id: int, max_count: int, *, max_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> tuple[int, bytes]:
        """Consecutive records from ``transaction_id`` as stored, each record checksum checked
        (:meth:`Segment.read_run`): ``(count, run)``; stops at the end of a segment; ``(0, b"")`` if the id is
        not in the log."""
        seg = self.segment_for(transaction_id)
        if seg is None:
            return 0, b""
        return seg.read_run(transaction_id, min(max_count, MAX_READ_RECORDS), max_bytes=max_bytes)

    def read_headers(
        self, transaction_id: int, max_count: int, *, max_bytes: int = DEFAULT_MAX_READ_BYTES
    ) -> list[RecordHeader]:
        """Like :meth:`read_records`, headers only (each record is still verified whole)."""
        out: list[RecordHeader] = []
        count = min(max_count, MAX_READ_RECORDS)
        txn = transaction_id
        while len(out) < count:
            seg = self.segment_for(txn)
            if seg is None:
                break
            got = seg.read_headers(txn, count - len(out), max_bytes=max_bytes)
            if not got:
                break
            out.extend(got)
            txn += len(got)
        return out

    def repair(self, records: Sequence[Record]) -> list[int]:
        """Overwrite stored records that do not verify with good copies; returns the ids rewritten, durable.

        Only a damaged record is touched, and only with a copy that verifies, carries the same id and has the
        same stored length (a committed record is identical on every replica, so a good copy always fits);
        anything else raises StorageError and changes nothing more. Records that verify are left alone, so a
        repair sent twice, or with a range around the damage, is harmless.
        """
        repaired: list[int] = []
        for rec in records:
            if not rec.verify():
                raise CorruptionError(f"repair copy of transaction {rec.transaction_id} fails its checksum")
            seg = self.segment_for(rec.transaction_id)
            if seg is None:
                raise StorageError(f"cannot repair transaction {rec.transaction_id}: not in this log")
            offset, stored = seg.stored_record(rec.transaction_id)
            try:
                seg.read_records(rec.transaction_id, 1)
                continue  # This copy is good.
            except CorruptionError:
                pass
            good = encode_run((rec,))
            if len(good) != len(stored):
                raise StorageError(
                    f"cannot repair transaction {rec.transaction_id}: the copy is {len(good)} bytes, the "
                    f"stored record {len(stored)} (the index itself may be damaged)"
                )
            f = self._fs.open(seg.data_path)
            try:
                f.pwrite(good, offset)
                f.fsync(data_only=True)
            finally:
                f.close()
            seg.read_records(rec.transaction_id, 1)  # Verify what is now on disk, right after writing it.
            repaired.append(rec.transaction_id)
        return repaired

    # --------------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Fsync and close the writable segment and close every cached one. Idempotent."""
        cached = list(self._cache.values())
        self._cache.clear()
        current, self._current = self._current, None
        try:
            if current is not None:
                current.close()
        finally:
            for seg in cached:
                seg.close()

    def delete_files(self) -> None:
        """Close the log and remove all its segment files and its directory."""
        self.close()
        delete_log_files(self._fs, self.directory)
        self._first_ids = []

    def __enter__(self) -> PartitionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _list_segments(fs: FileSystem, directory: str) -> tuple[list[int], set[int]]:
    """The first ids of the partition's data files, sorted, and those of its index files; an index file
    without its data file (left by a crash while deleting) is removed."""
    segs: set[int] = set()
    idxs: set[int] = set()
    for name in fs.listdir(directory):
        parsed = parse_segment_name(name)
        if parsed is not None:
            (segs if parsed[1] == ".seg" else idxs).add(parsed[0])
    for orphan in sorted(idxs - segs):
        log.warning("%s: removing index %s without a data file", directory, index_file_name(orphan))
        fs.remove(os.path.join(directory, index_file_name(orphan)))
    if idxs - segs:
        fs.fsync_dir(directory)
    first_ids = sorted(segs)
    return first_ids, idxs


def _open_newest_segment(
    fs: FileSystem,
    directory: str,
    key: uuid.UUID,
    partition_id: int,
    first_ids: list[int],
    idxs: set[int],
    local_low_water_mark: int,
    clock_ms: Callable[[], int],
) -> tuple[Segment, list[int]]:
    """Open the newest segment writable and recover it (removing one a crash left half-created), or create
    segment 0 when there is none; returns it and the first ids of the segments kept."""
    current: Segment | None = None
    while first_ids and current is None:
        first = first_ids[-1]
        if is_half_created(fs, directory, first, first in idxs):
            log.warning("%s: removing segment %d left half-created by a crash", directory, first)
            fs.remove(os.path.join(directory, data_file_name(first)))
            fs.remove(os.path.join(directory, index_file_name(first)))
            fs.fsync_dir(directory)
            first_ids.pop()
            continue
        if first not in idxs:
            raise CorruptionError(f"{directory}: segment {first} has records but no index file")
        current = Segment.open(
            fs,
            directory,
            first,
            key=key,
            partition_id=partition_id,
            writable=True,
            recover=True,
            local_low_water_mark=local_low_water_mark,
        )
    if current is None:
        current = Segment.create(fs, directory, key, partition_id, 0, clock_ms=clock_ms)
        first_ids = [0]
    return current, first_ids


def delete_log_files(fs: FileSystem, directory: str) -> None:
    """Remove a partition directory's segment files and the directory (if nothing else is in it), without
    opening the log: files that would not open (corrupt, half-created) go too. No-op if it does not exist."""
    if not fs.exists(directory):
        return
    for name in fs.listdir(directory):
        if parse_segment_name(name) is not None:
            fs.remove(os.path.join(directory, name))
    fs.fsync_dir(directory)
    try:
        fs.rmdir(directory)
    except StorageError as e:
        log.warning("%s: directory left in place: %s", directory, e)
        return
    fs.fsync_dir(os.path.dirname(os.path.normpath(directory)) or ".")


def is_half_created(fs: FileSystem, directory: str, first: int, has_index: bool) -> bool:
    """True for a segment whose creation a crash interrupted: no record, and a header or index missing."""
    data = fs.open(os.path.join(directory, data_file_name(first)), read_only=True)
    try:
        if data.size() > SEGMENT_HEADER_BYTES:
            return False
        if not has_index:
            return True
        raws: list[bytes] = []
        for f_path in (data.path, os.path.join(directory, index_file_name(first))):
            f = fs.open(f_path, read_only=True)
            try:
                raw = f.pread(SEGMENT_HEADER_BYTES, 0)
            finally:
                f.close()
            try:
                SegmentHeader.decode(raw, f_path)
            except (CorruptionError, FormatVersionError):
                # A short or unreadable header on a file with no record (its version field garbled by a crash
                # too, since a header is not fsynced before it is whole): its creation never completed. A
                # readable header of another key or partition is not ours to delete: Segment.open reports it.
                return True
            raws.append(raw)
        # Both headers are written with the same bytes, the data file's fsynced before the index is created:
        # an index header that differs (a torn write that kept the version field) was cut short too.
        return raws[0] != raws[1]
    finally:
        data.close()
