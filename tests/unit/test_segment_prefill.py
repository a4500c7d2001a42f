"""Zero-filled segments: the writable segment's data file is kept zero-filled ahead of its last record
(``Segment.prefill``), and everything that reads the file treats an all-zero tail as free space, never as
records and never as corruption, while a torn record or real damage is handled exactly as before."""

from __future__ import annotations

import logging
import uuid
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from waltz.cli.disk import dump_segment, offline_max_transaction_id, segment_stats, verify_segment
from waltz.errors import CorruptionError
from waltz.protocol.records import Record, ReqId
from waltz.storage.fileio import make_dirs_durable
from waltz.storage.partition import PartitionLog
from waltz.storage.segment import (
    PREFILL_CHUNK_BYTES,
    SEGMENT_HEADER_BYTES,
    Segment,
    data_file_name,
    encode_stored_run,
)
from waltz.testing.crashfs import CrashFS

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
PID = 3
DIR = "/p"
AHEAD = 8192


def rec(txn: int, size: int = 16) -> Record:
    data = bytes((txn * 7 + i + 1) & 0xFF for i in range(size))
    return Record.build(txn, ReqId.of(1, 2, PID, txn), txn % 5, data)


def recs(first: int, n: int, size: int = 16) -> list[Record]:
    return [rec(i, size) for i in range(first, first + n)]


def new_segment(fs: CrashFS) -> Segment:
    make_dirs_durable(fs, DIR)
    return Segment.create(fs, DIR, KEY, PID, 0, clock_ms=lambda: 1_600_000_000_000)


def reopen(fs: CrashFS) -> Segment:
    return Segment.open(fs, DIR, 0, key=KEY, partition_id=PID, writable=True, recover=True)


def prefilled(fs: CrashFS, seg: Segment, ahead: int = AHEAD) -> None:
    """Prefill until nothing is missing, each chunk synced (through its own descriptor; a node leaves the
    chunk to its next group fsync instead)."""
    while (job := seg.prefill(ahead, 1 << 30)) is not None:
        job.sync()
        job.done()


def file_size(fs: CrashFS, path: str) -> int:
    return fs.open(path).size()


def test_an_all_zero_record_never_verifies() -> None:
    # What makes a zero tail safe: its first "record" would be n = 0 with record checksum 0, and the CRC-32 of
    # the 36-byte header of zeros is not 0 (nor is the checksum of any all-zero record of n = 0).
    assert zlib.crc32(bytes(36)) == 0x6AB6B2D5


def test_prefill_writes_zeros_ahead_and_appends_overwrite_them() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    job = seg.prefill(AHEAD, 1 << 30)
    assert job is not None
    assert job.end == SEGMENT_HEADER_BYTES + AHEAD // 2
    assert seg.prefilled_bytes == 0  # written, not yet durable
    job.sync()
    job.done()
    assert seg.prefilled_bytes == AHEAD // 2
    prefilled(fs, seg)
    assert file_size(fs, seg.data_path) == SEGMENT_HEADER_BYTES + AHEAD
    assert fs.open(seg.data_path).pread(AHEAD, SEGMENT_HEADER_BYTES) == bytes(AHEAD)

    seg.append(recs(0, 20))
    seg.flush()
    logical = SEGMENT_HEADER_BYTES + 20 * 56
    assert seg.size_bytes == logical  # the zeros after the records are not part of the segment
    assert file_size(fs, seg.data_path) == SEGMENT_HEADER_BYTES + AHEAD  # overwritten, not extended
    assert seg.prefilled_bytes == SEGMENT_HEADER_BYTES + AHEAD - logical
    assert seg.read_records(0, 100) == recs(0, 20)
    assert seg.verify() == []
    # More than half of the zeros are left: nothing to do yet; once fewer are, the next chunk goes at the end.
    assert seg.prefill(AHEAD, 1 << 30) is None
    seg.append(recs(20, 60))
    job = seg.prefill(AHEAD, 1 << 30)
    assert job is not None
    assert job.end == SEGMENT_HEADER_BYTES + AHEAD + AHEAD // 2
    job.sync()
    job.done()
    # Appends that outrun the zeros still work: they extend the file, as without preallocation.
    seg.append(recs(80, 400))
    assert seg.size_bytes > file_size(fs, seg.data_path) - 1
    assert seg.prefilled_bytes == 0
    assert seg.read_records(0, 1000) == recs(0, 480)
    seg.close()


def test_prefill_stops_at_the_roll_over_threshold_and_chunks_are_bounded() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    job = seg.prefill(AHEAD, 1000)
    assert job is not None
    assert job.end == 1000
    job.sync()
    assert seg.prefill(AHEAD, 1000) is None
    big = seg.prefill(64 * PREFILL_CHUNK_BYTES, 1 << 40)
    assert big is not None
    assert big.end == 1000 + PREFILL_CHUNK_BYTES
    big.sync()
    seg.close()


def test_reopen_with_a_zero_tail_keeps_every_record_and_cuts_the_zeros_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    prefilled(fs, seg)
    seg.append(recs(0, 30))
    seg.flush()
    fs.crash("apply")  # killed: no close, the zeros are still there
    with caplog.at_level(logging.WARNING):
        seg = reopen(fs)
    assert caplog.records == []  # free space, not a torn tail
    assert seg.max_transaction_id == 29
    assert file_size(fs, seg.data_path) == seg.size_bytes == SEGMENT_HEADER_BYTES + 30 * 56
    assert seg.read_records(0, 100) == recs(0, 30)
    seg.append(recs(30, 5))
    assert seg.read_records(0, 100) == recs(0, 35)
    seg.close()


def test_a_torn_record_followed_by_zeros_is_cut_like_a_torn_tail(caplog: pytest.LogCaptureFixture) -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    prefilled(fs, seg)
    seg.append(recs(0, 10))
    seg.flush()
    run, _ = encode_stored_run(recs(10, 3))
    fs.open(seg.data_path).pwrite(run[:75], seg.size_bytes)  # one whole record and part of the next
    fs.crash("apply")
    with caplog.at_level(logging.WARNING):
        seg = reopen(fs)
    assert seg.max_transaction_id == 10  # the whole record is kept, as a torn tail's would be
    assert file_size(fs, seg.data_path) == seg.size_bytes
    (warning,) = [r.getMessage() for r in caplog.records]
    # The torn record's 19 bytes, but its own trailing zeros cannot be told from the free space after them.
    torn = len(run[56:75].rstrip(b"\0"))
    assert 0 < torn <= 19
    assert f"cut {torn} bytes after transaction 10 (partial or unverified tail)" in warning
    assert "bytes of preallocated zeros after them" in warning
    seg.close()


def test_damage_before_valid_records_is_still_found_with_a_zero_tail() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    prefilled(fs, seg)
    seg.append(recs(0, 10))
    seg.flush()
    fs.corrupt(seg.data_path, seg.record_offset(4) + 38, b"\x99")
    with pytest.raises(CorruptionError, match="record 4"):
        seg.read_records(0, 10)
    path = f"{DIR}/{data_file_name(0)}"
    # The index entries still in memory: the tool's scan stops at the damage and counts what follows it,
    # the records after it but not the zeros.
    assert verify_segment(path, fs=fs) == [f"{6 * 56} bytes after the last indexed record"]
    seg.sync()  # the index written: the tool names the damaged record
    (problem,) = verify_segment(path, fs=fs)
    assert "record 4" in problem
    fs.crash("apply")
    # Recovery scans from the header (no checkpoint) and stops at the damage, but the index names records
    # 4..9 (entries reach the index file only after an fsync of their records): record 4 was durable, so it is
    # kept as a damaged record with everything after it, and the zeros are still cut.
    seg = reopen(fs)
    assert seg.max_transaction_id == 9
    assert seg.damaged_at_open == [4]
    assert seg.read_records(5, 10) == recs(5, 5)
    assert seg.size_bytes == file_size(fs, seg.data_path) == SEGMENT_HEADER_BYTES + 10 * 56
    seg.close()


def test_close_and_truncate_cut_the_zero_tail() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    prefilled(fs, seg)
    seg.append(recs(0, 10))
    late = seg.prefill(4 * AHEAD, 1 << 30)  # zeros in flight when the truncation comes
    assert late is not None
    seg.truncate(4)
    assert file_size(fs, seg.data_path) == seg.size_bytes == SEGMENT_HEADER_BYTES + 5 * 56
    late.sync()
    late.done()
    assert seg.prefilled_bytes == 0  # a zero fill from before the truncation counts for nothing
    prefilled(fs, seg)
    assert file_size(fs, seg.data_path) > seg.size_bytes
    seg.close()
    assert file_size(fs, seg.data_path) == SEGMENT_HEADER_BYTES + 5 * 56
    assert fs.open(seg.data_path).size() == SEGMENT_HEADER_BYTES + 5 * 56


def test_prefill_looks_again_after_a_truncation_cut_its_zeros() -> None:
    # prefill remembers how far its zeros reach (a node calls it after every group, and asking the file each
    # time cost three calls); a truncation cuts the zeros, and the next prefill must write them again.
    fs = CrashFS()
    seg = new_segment(fs)
    prefilled(fs, seg)
    seg.append(recs(0, 10))
    assert seg.prefill(AHEAD, 1 << 30) is None  # the zeros reach far enough ahead
    assert seg.prefill(AHEAD, 1 << 30) is None
    seg.truncate(4)
    job = seg.prefill(AHEAD, 1 << 30)
    assert job is not None
    assert (job.start, job.end) == (seg.size_bytes, seg.size_bytes + AHEAD // 2)
    job.sync()
    job.done()
    seg.close()


def test_roll_over_cuts_the_zeros_of_the_full_segment(tmp_path: Path) -> None:
    log = PartitionLog.open(str(tmp_path), KEY, PID, segment_size_threshold_bytes=4096)
    try:
        txn = 0
        while len(log.segment_first_ids) < 3:
            while (job := log.prefill(AHEAD)) is not None:
                job.sync()
                job.done()
            log.append(recs(txn, 7))
            txn += 7
        job = log.prefill(AHEAD)
        assert job is not None
        job.sync()
        log.flush()
        for first in log.segment_first_ids[:-1]:
            seg = log.segment_for(first)
            assert seg is not None
            assert (tmp_path / str(PID) / data_file_name(first)).stat().st_size == seg.size_bytes
            assert seg.verify() == []
        newest = tmp_path / str(PID) / data_file_name(log.segment_first_ids[-1])
        newest_seg = log.segment_for(log.max_transaction_id)
        assert newest_seg is not None
        assert newest.stat().st_size > newest_seg.size_bytes  # the writable one keeps its zeros
        logical = newest_seg.size_bytes
        assert log.read_records(0, 10_000) == recs(0, txn)
    finally:
        log.close()
    assert newest.stat().st_size == logical  # closed: cut to its last record


def test_tools_on_a_prefilled_newest_segment(tmp_path: Path) -> None:
    """A running (or killed) node's newest segment ends in zeros: verify, stats, dump and the offline max id
    see its records and call the zeros free space."""
    log = PartitionLog.open(str(tmp_path), KEY, PID)
    try:
        while (job := log.prefill(1 << 20)) is not None:
            job.sync()
            job.done()
        log.append(recs(0, 1010))
        log.flush()  # no close: the zeros stay, and the entries after the checkpoint at 1000 wait in memory
        path = str(tmp_path / str(PID) / data_file_name(0))
        logical = SEGMENT_HEADER_BYTES + 1010 * 56
        assert Path(path).stat().st_size == SEGMENT_HEADER_BYTES + (1 << 20)
        assert verify_segment(path) == []
        assert segment_stats(path).rows == 1010
        assert len(dump_segment(path, records=True)) == 1010
        meta = dump_segment(path, metadata=True)
        assert f"data bytes: {logical}" in meta
        assert f"preallocated zero bytes: {SEGMENT_HEADER_BYTES + (1 << 20) - logical}" in meta
        assert offline_max_transaction_id(tmp_path, PID) == 1009
        # A torn record before the zeros is still reported, and only its bytes.
        with open(path, "r+b") as f:
            f.seek(logical)
            f.write(b"\x07" * 30)
        assert verify_segment(path) == ["30 bytes after the last indexed record"]
        assert offline_max_transaction_id(tmp_path, PID) == 1009
    finally:
        log.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=hs.lists(hs.integers(1, 40), min_size=1, max_size=12),
    sizes=hs.sampled_from([0, 1, 16, 300]),
    flushed=hs.integers(0, 12),
    torn_fraction=hs.floats(0, 1),
    zeros_synced=hs.booleans(),
)
def test_a_crash_at_any_byte_recovers_the_same_records_with_and_without_prefill(
    batches: list[int], sizes: int, flushed: int, torn_fraction: float, zeros_synced: bool
) -> None:
    """Batches appended (the first ``flushed`` fsynced), then the next batch torn at any byte by the crash:
    the records recovered are the same whether the file was zero-filled ahead or not."""
    outcomes = []
    for prefill in (False, True):
        fs = CrashFS()
        seg = new_segment(fs)
        txn = 0
        for k, n in enumerate(batches):
            if prefill:
                job = seg.prefill(AHEAD, 1 << 30)
                if job is not None and zeros_synced:
                    job.sync()
                    job.done()
            seg.append(recs(txn, n, sizes))
            txn += n
            if k < flushed:
                seg.flush()
        run, _ = encode_stored_run(recs(txn, 5, sizes))
        torn = run[: int(len(run) * torn_fraction)]
        fs.open(seg.data_path).pwrite(torn, seg.size_bytes)  # the write the crash cut short
        fs.crash("apply")  # killed: every write issued (as far as it got) reached the page cache
        seg = reopen(fs)
        got = seg.read_records(0, 10_000) if seg.max_transaction_id >= 0 else []
        assert file_size(fs, seg.data_path) == seg.size_bytes
        seg.close()
        outcomes.append(got)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][:txn] == recs(0, txn, sizes)


def test_a_node_killed_right_after_a_roll_over_leaves_a_segment_of_zeros_only(tmp_path: Path) -> None:
    """The new segment got its headers and its first zeros, no record: the tools and the node's recovery
    see an empty segment after the full one, not a half-created one nor damage."""
    log = PartitionLog.open(str(tmp_path), KEY, PID, segment_size_threshold_bytes=2048)
    while len(log.segment_first_ids) < 2:
        log.append(recs(log.max_transaction_id + 1, 7))
    log.truncate(log.segment_first_ids[-1] - 1)  # back to an empty newest segment, as right after the roll
    log.flush()
    last = log.max_transaction_id
    job = log.prefill(AHEAD)
    assert job is not None
    job.sync()
    newest = tmp_path / str(PID) / data_file_name(last + 1)
    assert newest.stat().st_size == 2048  # headers and zeros up to the roll-over threshold, no record
    assert verify_segment(str(newest)) == []
    assert offline_max_transaction_id(tmp_path, PID) == last
    killed = log._writable()  # killed: its descriptors go, nothing is cut
    assert killed._data is not None
    assert killed._index is not None
    killed._data.close()
    killed._index.close()
    killed._data = killed._index = None
    log.close()
    with PartitionLog.open(str(tmp_path), KEY, PID, segment_size_threshold_bytes=2048) as again:
        assert again.max_transaction_id == last
        assert again.segment_first_ids[-1] == last + 1
        assert again.read_records(0, 1000) == recs(0, last + 1)
    assert newest.stat().st_size == SEGMENT_HEADER_BYTES
