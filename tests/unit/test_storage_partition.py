"""PartitionLog: rollover, lookup, LRU cache, truncation across segments, crash recovery at every write."""

from __future__ import annotations

import contextlib
import itertools
import random
import uuid
from pathlib import Path

import pytest

from waltz.cli.disk import offline_max_transaction_id
from waltz.errors import CorruptionError, StorageError, TransactionOutOfOrderError
from waltz.protocol.record_run import RecordRun
from waltz.protocol.records import Record, ReqId
from waltz.storage.fileio import make_dirs_durable
from waltz.storage.partition import PartitionLog
from waltz.storage.segment import (
    RecordCorruptionError,
    Segment,
    SegmentHeader,
    data_file_name,
    index_file_name,
)
from waltz.testing.crashfs import CrashFS, SimulatedCrash

KEY = uuid.UUID("0e0e0e0e-1111-2222-3333-444455556666")
PID = 0
ROOT = "/store"
PDIR = f"{ROOT}/{PID}"


def make(txn: int) -> Record:
    """A record fully determined by its id (so a survivor can be checked byte for byte)."""
    size = (txn * 13) % 23
    data = bytes((txn + i) & 0xFF for i in range(size))
    return Record.build(txn, ReqId.of(7, 1, PID, txn), txn & 0xFFFF, data)


def batch(first: int, n: int) -> list[Record]:
    return [make(i) for i in range(first, first + n)]


def open_log(fs: CrashFS, threshold: int = 1_000_000, cache: int = 5, llwm: int = -1) -> PartitionLog:
    return PartitionLog.open(
        ROOT,
        KEY,
        PID,
        fs=fs,
        segment_size_threshold_bytes=threshold,
        segment_cache_capacity=cache,
        local_low_water_mark=llwm,
    )


def fill(log: PartitionLog, n: int, step: int = 10) -> None:
    first = log.max_transaction_id + 1
    for i in range(first, first + n, step):
        log.append(batch(i, min(step, first + n - i)))
    log.flush()


def check_all(log: PartitionLog) -> None:
    top = log.max_transaction_id
    txn = 0
    while txn <= top:
        got = log.read_records(txn, 500)
        assert got, txn
        assert got == batch(txn, len(got))
        txn += len(got)


def test_empty_log() -> None:
    fs = CrashFS()
    with open_log(fs) as log:
        assert log.max_transaction_id == -1
        assert log.read_record(0) is None
        assert log.read_records(0, 10) == []
        assert log.segment_first_ids == [0]
        assert log.truncate(-1) == -1
    assert fs.listdir(PDIR) == sorted([data_file_name(0), index_file_name(0)])


def test_append_out_of_order() -> None:
    fs = CrashFS()
    with open_log(fs) as log:
        log.append(batch(0, 3))
        with pytest.raises(TransactionOutOfOrderError):
            log.append(batch(4, 1))
        with pytest.raises(TransactionOutOfOrderError):
            log.append([make(3), make(5)])
        log.append([])
        assert log.max_transaction_id == 2


def test_rollover_with_tiny_threshold() -> None:
    fs = CrashFS()
    with open_log(fs, threshold=128) as log:
        # Every record passes the threshold: one segment per record, split inside batches.
        log.append(batch(0, 7))
        log.append(batch(7, 3))
        log.flush()
        assert log.segment_first_ids == list(range(10))
        check_all(log)
    with open_log(fs, threshold=128) as log:
        assert log.max_transaction_id == 9
        check_all(log)
        log.append(batch(10, 1))
        assert log.segment_first_ids[-1] == 10


def test_rollover_keeps_segments_contiguous() -> None:
    fs = CrashFS()
    with open_log(fs, threshold=2000) as log:
        fill(log, 3000, step=17)
        firsts = log.segment_first_ids
        assert len(firsts) > 10
        for a, b in itertools.pairwise(firsts):
            seg = log.segment_for(a)
            assert seg is not None
            assert seg.max_transaction_id == b - 1
            assert seg.size_bytes > 2000
        check_all(log)
    with open_log(fs, threshold=2000) as log:
        assert log.max_transaction_id == 2999
        check_all(log)


def test_lookup_across_many_segments_and_lru_bound() -> None:
    fs = CrashFS()
    with open_log(fs, threshold=300, cache=3) as log:
        fill(log, 2000, step=7)
        firsts = log.segment_first_ids
        assert len(firsts) > 50
        rng = random.Random(5)
        for _ in range(300):
            txn = rng.randrange(2000)
            assert log.read_record(txn) == make(txn)
            assert log.read_header(txn) == make(txn).header_only()
            assert log.cached_segment_count <= 3
        # List reads continue across segment boundaries.
        assert log.read_records(0, 2000) == batch(0, 2000)
        assert log.read_headers(100, 300) == [r.header_only() for r in batch(100, 300)]
        # Runs stop at the end of a segment; read one after another they cover the log.
        runs, txn = [], 0
        while (got := log.read_run(txn, 2000))[0]:
            runs.append(RecordRun(txn, *got))
            txn += got[0]
        assert len(runs) == len(firsts)
        assert [r.first for r in runs] == firsts
        assert [rec for r in runs for rec in r.records()] == batch(0, 2000)
        assert log.read_run(2000, 5) == (0, b"")
        assert log.read_record(2000) is None
        assert log.read_record(-1) is None


def test_lru_closes_evicted_segments() -> None:
    fs = CrashFS()
    with open_log(fs, threshold=200, cache=2) as log:
        fill(log, 100, step=3)
        firsts = log.segment_first_ids
        segs: list[Segment] = []
        for first in firsts[:3]:
            seg = log.segment_for(first)
            assert seg is not None
            segs.append(seg)
        assert segs[0].closed
        assert not segs[1].closed
        assert not segs[2].closed
        # A recently used segment survives eviction.
        log.read_record(firsts[1])
        log.read_record(firsts[3])
        assert not segs[1].closed
        assert segs[2].closed


@pytest.mark.parametrize("target", [-1, 0, 57, 60, 61, 150, 398, 399, 500])
def test_truncate_across_segments(target: int) -> None:
    fs = CrashFS()
    with open_log(fs, threshold=1000) as log:
        fill(log, 400, step=9)
        firsts = log.segment_first_ids
        new_max = log.truncate(target)
        expected = min(target, 399)
        assert new_max == expected == log.max_transaction_id
        assert log.read_record(expected + 1) is None
        kept = [f for f in firsts if f <= expected + 1] or [0]
        assert log.segment_first_ids == kept
        check_all(log)
        # The log continues from the cut.
        log.append(batch(expected + 1, 50))
        log.flush()
        check_all(log)
    fs.crash()
    with open_log(fs, threshold=1000) as log:
        assert log.max_transaction_id == expected + 50
        check_all(log)


def test_truncate_to_segment_boundary_keeps_empty_segment() -> None:
    fs = CrashFS()
    with open_log(fs, threshold=500) as log:
        fill(log, 200)
        firsts = log.segment_first_ids
        b = firsts[2]
        assert log.truncate(b - 1) == b - 1
        assert log.segment_first_ids == firsts[:3]
        with pytest.raises(StorageError):
            log.truncate(-2)


def test_crash_leftovers_are_cleaned_at_open() -> None:
    fs = CrashFS()
    with open_log(fs, threshold=500) as log:
        fill(log, 100)
        last = log.max_transaction_id
    # A deletion cut short left an index without data; a creation cut short left a header-less data file.
    fs.open(f"{PDIR}/{index_file_name(5000)}", create=True).pwrite(b"junk", 0)
    fs.open(f"{PDIR}/{data_file_name(last + 1)}", create=True).pwrite(b"\x00" * 40, 0)
    with open_log(fs, threshold=500) as log:
        assert log.max_transaction_id == last
        check_all(log)
    assert index_file_name(5000) not in fs.listdir(PDIR)
    assert data_file_name(last + 1) not in fs.listdir(PDIR)


def test_a_segment_whose_index_header_was_torn_at_creation_is_cleaned_at_open() -> None:
    """A crash while a new segment's index header was being written can leave it torn: its version field
    written, the rest garbled. Its data file holds no record and its header is fsynced before the index is
    created, so the segment was never used: it is removed as half-created, not reported as another
    cluster's."""
    fs = CrashFS()
    with open_log(fs, threshold=500) as log:
        fill(log, 100)
        last = log.max_transaction_id
        firsts = log.segment_first_ids
    header = SegmentHeader(0, 1, KEY, PID, last + 1).encode()
    fs.open(f"{PDIR}/{data_file_name(last + 1)}", create=True).pwrite(header, 0)
    fs.open(f"{PDIR}/{index_file_name(last + 1)}", create=True).pwrite(header[:8] + bytes(range(120)), 0)
    with open_log(fs, threshold=500) as log:
        assert log.max_transaction_id == last
        assert log.segment_first_ids == firsts
        check_all(log)
    assert data_file_name(last + 1) not in fs.listdir(PDIR)


def test_missing_index_with_records_is_corruption() -> None:
    fs = CrashFS()
    with open_log(fs) as log:
        fill(log, 10)
    fs.remove(f"{PDIR}/{index_file_name(0)}")
    with pytest.raises(CorruptionError, match="no index"):
        open_log(fs)


def test_inconsistent_older_segment_is_corruption() -> None:
    fs = CrashFS()
    with open_log(fs, threshold=300) as log:
        fill(log, 100)
        firsts = log.segment_first_ids
    fs.open(f"{PDIR}/{index_file_name(firsts[-2])}").truncate(128 + 8)
    with pytest.raises(CorruptionError, match="next segment starts"):
        open_log(fs, threshold=300)


def test_corrupt_record_detected_on_read() -> None:
    fs = CrashFS()
    with open_log(fs) as log:
        fill(log, 10)
        seg = log.segment_for(4)
        assert seg is not None
        fs.corrupt(seg.data_path, seg.record_offset(4) + 10, b"\x99\x99")
        with pytest.raises(CorruptionError):
            log.read_record(4)
        with pytest.raises(CorruptionError):
            log.read_headers(0, 10)


def test_delete_files() -> None:
    fs = CrashFS()
    log = open_log(fs, threshold=300)
    fill(log, 100)
    log.delete_files()
    assert not fs.exists(PDIR)
    with open_log(fs) as log2:
        assert log2.max_transaction_id == -1


def test_bad_limits() -> None:
    fs = CrashFS()
    with pytest.raises(StorageError, match="segment_size_threshold_bytes"):
        open_log(fs, threshold=10)
    with pytest.raises(StorageError, match="segment_cache_capacity"):
        open_log(fs, cache=0)


def test_closed_log() -> None:
    fs = CrashFS()
    log = open_log(fs)
    log.close()
    log.close()
    with pytest.raises(StorageError, match="closed"):
        log.append(batch(0, 1))


def test_real_files(tmp_path: Path) -> None:
    root = str(tmp_path)
    log = PartitionLog.open(root, KEY, 4, segment_size_threshold_bytes=4096)
    log.append([r._replace(req_id=ReqId.of(7, 1, 4, r.transaction_id)) for r in batch(0, 1500)])
    log.flush()
    firsts = log.segment_first_ids
    log.close()
    log = PartitionLog.open(root, KEY, 4, segment_size_threshold_bytes=4096)
    assert log.segment_first_ids == firsts
    assert log.max_transaction_id == 1499
    assert log.truncate(700) == 700
    log.close()
    assert (tmp_path / "4" / data_file_name(0)).exists()


# ------------------------------------------------------------------------------------- crash at every point

CRASH_RECORDS = 2300  # crosses two checkpoints (1000, 2000)
CRASH_THRESHOLD_BYTES = 6000  # several rollovers


def _prefill_now_and_then(log: PartitionLog, rng: random.Random, ahead: int) -> None:
    """As the node does after a group commit: write the next zeros ahead, sync them (or leave them unsynced,
    as when the crash comes while the background fsync runs)."""
    if ahead and (job := log.prefill(ahead)) is not None and rng.random() < 0.7:
        job.sync()
        job.done()


def _workload(fs: CrashFS, seed: int, durable: list[int], prefill: int = 0) -> None:
    """Append in random batches, flushing now and then; ``durable[0]`` tracks the last flushed id.
    ``prefill``: keep that many bytes zero-filled ahead of the last record."""
    rng = random.Random(seed)
    log = open_log(fs, threshold=CRASH_THRESHOLD_BYTES, llwm=durable[0])
    txn = log.max_transaction_id + 1
    while txn < CRASH_RECORDS:
        n = min(rng.randint(1, 80), CRASH_RECORDS - txn)
        log.append(batch(txn, n))
        txn += n
        if rng.random() < 0.4:
            log.flush()
            durable[0] = txn - 1
            if rng.random() < 0.5:
                log.write_flushed_index()  # as the node does after group fsyncs
        _prefill_now_and_then(log, rng, prefill)
    log.flush()
    durable[0] = txn - 1
    log.close()


def _count_ops(seed: int, prefill: int = 0) -> int:
    fs = CrashFS(seed)
    _workload(fs, seed, [-1], prefill)
    return fs.ops


def _crash_and_check(seed: int, crash_at: int, prefill: int = 0) -> None:
    fs = CrashFS(seed * 100_003 + crash_at)
    durable = [-1]
    fs.arm(crash_at)
    try:
        _workload(fs, seed, durable, prefill)
    except SimulatedCrash:
        pass
    fs.crash()
    log = open_log(fs, threshold=CRASH_THRESHOLD_BYTES, llwm=durable[0])
    try:
        top = log.max_transaction_id
        # Every fsynced record survived; whatever else survived is exactly what was written.
        assert top >= durable[0], (seed, crash_at, top, durable[0])
        check_all(log)
        for first in log.segment_first_ids:
            seg = log.segment_for(first)
            if seg is not None:
                assert seg.verify() == [], (seed, crash_at, first)
        # The tail was cut cleanly: the last segment ends right after its last record, its zeros cut too.
        last = log.segment_for(top)
        if last is not None:
            assert last.size_bytes == last.record_offset(top) + 40 + len(make(top).data)
            assert fs.open(last.data_path).size() == last.size_bytes
    finally:
        log.close()
    # And the log carries on: finish the workload and check everything again.
    _workload(fs, seed, durable, prefill)
    with open_log(fs, threshold=CRASH_THRESHOLD_BYTES) as log:
        assert log.max_transaction_id == CRASH_RECORDS - 1
        check_all(log)


@pytest.mark.slow
def test_crash_at_every_operation() -> None:
    seed = 11
    total = _count_ops(seed)
    assert total > 100
    for crash_at in range(total):
        _crash_and_check(seed, crash_at)


@pytest.mark.parametrize("seed", range(6))
def test_crash_at_random_operations(seed: int) -> None:
    total = _count_ops(seed)
    rng = random.Random(seed)
    for crash_at in rng.sample(range(total), 15):
        _crash_and_check(seed, crash_at)


@pytest.mark.parametrize("seed", range(6))
def test_crash_at_random_operations_with_zero_filled_segments(seed: int) -> None:
    """The same with the data file kept zero-filled ahead (zeros synced or not when the crash comes, and then
    applied, dropped, torn or garbled like any write): nothing fsynced is lost, the zeros never count."""
    total = _count_ops(seed, prefill=1024)
    rng = random.Random(seed)
    for crash_at in rng.sample(range(total), 15):
        _crash_and_check(seed, crash_at, prefill=1024)


def test_repair_overwrites_only_a_damaged_record_with_a_good_copy() -> None:
    fs = CrashFS()
    with open_log(fs, threshold=2000) as log:
        fill(log, 200)
        seg = log.segment_for(20)
        assert seg is not None
        offset, _ = seg.stored_record(20)
        fs.corrupt(seg.data_path, offset + 10, b"\xee")
        with pytest.raises(CorruptionError, match="record 20"):
            log.read_run(15, 10)
        # A copy that does not verify, or of another length, is refused; good records are left alone.
        bad_copy = Record(20, make(20).req_id, make(20).header, make(20).data + b"x", make(20).checksum)
        with pytest.raises(CorruptionError):
            log.repair([bad_copy])
        with pytest.raises(StorageError, match="bytes"):
            log.repair([Record.build(20, make(20).req_id, 0, b"another length entirely")])
        assert log.repair(batch(15, 10)) == [20]
        assert log.repair(batch(15, 10)) == []
        check_all(log)
        count, run = log.read_run(15, 10)
        assert RecordRun(15, count, run).records() == batch(15, count)


def test_read_wire_is_read_records_in_wire_form_across_segments_and_bounds() -> None:
    # What a RecordListRequest is answered with: the same records, counts and byte bounds as read_records,
    # built from the stored bytes without a Record per record.
    from waltz.protocol import storage as st

    fs = CrashFS()
    with open_log(fs, threshold=600) as log:
        fill(log, 120)
        assert len(log.segment_first_ids) > 3
        for start, n, max_bytes in [
            (0, 500, 1 << 20),
            (7, 40, 1 << 20),
            (30, 60, 200),
            (5, 3, 0),
            (119, 9, 99),
        ]:
            wire = log.read_wire(start, n, max_bytes=max_bytes)
            assert list(wire) == log.read_records(start, n, max_bytes=max_bytes), (start, n, max_bytes)
            payload = st.encode(st.RecordListResponse(1, 2, PID, wire))
            decoded = st.decode(payload)
            assert isinstance(decoded, st.RecordListResponse)
            assert decoded.records == tuple(log.read_records(start, n, max_bytes=max_bytes))
        assert len(log.read_wire(120, 5)) == 0
        assert len(log.read_wire(-1, 5)) == 0


def test_read_wire_refuses_a_damaged_record_and_names_it() -> None:
    fs = CrashFS()
    with open_log(fs) as log:
        fill(log, 10)
        seg = log.segment_for(4)
        assert seg is not None
        fs.corrupt(seg.data_path, seg.record_offset(4) + 38, b"\x99")  # in the data (or its record checksum)
        with pytest.raises(RecordCorruptionError, match="record 4") as caught:
            log.read_wire(0, 10)
        assert caught.value.transaction_id == 4
        assert list(log.read_wire(0, 4)) == batch(0, 4)


# ------------------------------------- crash with index entries in memory: long segments, truncates, reads

LONG_RECORDS = 4500  # crosses several checkpoints in one segment
LONG_THRESHOLD_BYTES = 120_000  # ~2300 records a segment: a roll-over or two, checkpoints inside each


def _generation_record(txn: int, generation: int) -> Record:
    """A record of ``txn`` that differs after each truncate, so a truncated record coming back shows."""
    size = (txn * 13 + generation) % 23
    data = bytes((txn + generation + i) & 0xFF for i in range(size))
    return Record.build(txn, ReqId.of(7, generation, PID, txn), txn & 0xFFFF, data)


def _long_workload(fs: CrashFS, seed: int, written: list[Record], acked: list[int], prefill: int = 0) -> None:
    """Append, flush, truncate and read back at random; ``written`` is what was handed to the log (a record
    joins it before its append starts), ``acked[0]`` how many of its records were acknowledged durable."""
    rng = random.Random(seed)
    generation = seed * 1000
    log = open_log(fs, threshold=LONG_THRESHOLD_BYTES)
    while len(written) < LONG_RECORDS:
        txn = len(written)
        batch_ = [_generation_record(t, generation) for t in range(txn, txn + rng.randint(1, 120))]
        written += batch_
        log.append(batch_)
        # Reads of the newest records (their index entries in memory) and of older ones.
        for t in (len(written) - 1, rng.randrange(len(written))):
            assert log.read_record(t) == written[t]
        _prefill_now_and_then(log, rng, prefill)
        roll = rng.random()
        if roll < 0.3:
            log.flush()
            acked[0] = len(written)
            if rng.random() < 0.5:
                log.write_flushed_index()  # as the node does after group fsyncs
        elif roll < 0.34 and len(written) > 10:
            target = max(-1, len(written) - 1 - rng.randint(0, 1500))
            # The caller gives up the records after the target as it asks: a crash part-way may cut them.
            acked[0] = min(acked[0], target + 1)
            assert log.truncate(target) == target
            del written[target + 1 :]
            generation += 1
    log.close()  # not after a crash: the process is gone


@pytest.mark.parametrize("prefill", [0, 8192])
@pytest.mark.parametrize("seed", range(8))
def test_crash_with_index_entries_in_memory_loses_nothing_acknowledged(seed: int, prefill: int) -> None:
    """A crash at a random operation of a workload of long segments (checkpoints inside them, index entries
    after the last one in memory), truncates and reads: recovery keeps every acknowledged record, brings back
    no truncated one, and every segment verifies."""
    rng = random.Random(seed)
    probe = CrashFS(seed)
    _long_workload(probe, seed, [], [0], prefill)
    for crash_at in rng.sample(range(probe.ops), 4):
        fs = CrashFS(seed * 100_003 + crash_at)
        written: list[Record] = []
        acked = [0]
        fs.arm(crash_at)
        with contextlib.suppress(SimulatedCrash):
            _long_workload(fs, seed, written, acked, prefill)
        fs.crash()
        with open_log(fs, threshold=LONG_THRESHOLD_BYTES) as log:
            top = log.max_transaction_id
            assert acked[0] - 1 <= top < len(written), (seed, crash_at, top, acked[0])
            got: list[Record] = []
            while len(got) <= top:
                more = log.read_records(len(got), 500)
                assert more, (seed, crash_at, len(got))
                got += more
            assert got == written[: top + 1], (seed, crash_at)
            for first in log.segment_first_ids:
                seg = log.segment_for(first)
                if seg is not None:
                    assert seg.verify() == [], (seed, crash_at, first)


# With zero-filled segments for one seed only: every operation of that workload takes ~35 s for seed 0.
@pytest.mark.parametrize(("seed", "prefill"), [(0, 0), (1, 0), (1, 8192)])
def test_offline_max_id_after_a_kill_at_every_operation_is_what_the_node_keeps(
    seed: int, prefill: int
) -> None:
    """A process killed at any operation (every write reached the page cache, as at kill -9: index entries
    in memory lost, a truncate or roll-over cut part-way): ``waltz storage max-transaction-id --offline``
    on its files says what the node's recovery then keeps."""
    probe = CrashFS(seed)
    _long_workload(probe, seed, [], [0], prefill)
    for crash_at in range(probe.ops):
        fs = CrashFS(seed * 100_003 + crash_at)
        fs.arm(crash_at)
        with contextlib.suppress(SimulatedCrash):
            _long_workload(fs, seed, [], [0], prefill)
        fs.crash("apply")
        if not fs.exists(PDIR):  # killed before the partition directory was made: nothing to read
            with open_log(fs, threshold=LONG_THRESHOLD_BYTES) as log:
                assert log.max_transaction_id == -1, (seed, crash_at)
            continue
        offline = offline_max_transaction_id(ROOT, PID, fs=fs)
        with open_log(fs, threshold=LONG_THRESHOLD_BYTES) as log:
            assert offline == log.max_transaction_id, (seed, crash_at)


# ------------------------------------------- directory entries: durable only at an fsync of their directory


def test_a_power_cut_keeps_the_partition_directory_of_acknowledged_records() -> None:
    """A new partition's directory (and the storage directory above it) is created durably: a power cut that
    drops every directory operation not fsynced loses none of the flushed records (it lost all of them when
    ``PartitionLog.open`` made the directory with a plain makedirs)."""
    fs = CrashFS()
    log = open_log(fs, threshold=500)
    fill(log, 100)
    acked = log.max_transaction_id
    fs.crash("drop")  # the process is gone: its log is never closed
    with open_log(fs, threshold=500) as log:
        assert log.max_transaction_id == acked
        check_all(log)


def test_a_power_cut_does_not_bring_back_segments_a_truncation_removed() -> None:
    fs = CrashFS()
    log = open_log(fs, threshold=300)
    fill(log, 100)
    firsts = log.segment_first_ids
    assert len(firsts) > 3
    assert log.truncate(firsts[1]) == firsts[1]
    fs.crash("drop")
    with open_log(fs, threshold=300) as log:
        assert log.max_transaction_id == firsts[1]
        assert log.segment_first_ids == firsts[:2]
        check_all(log)


def test_a_deleted_partition_stays_deleted_after_a_power_cut() -> None:
    fs = CrashFS()
    log = open_log(fs, threshold=300)
    fill(log, 100)
    log.delete_files()
    fs.crash("drop")
    assert not fs.exists(PDIR)


def test_every_directory_operation_of_a_workload_is_a_crash_point() -> None:
    """The crash-at-every-operation workloads crash at directory operations too: creating the directories,
    each segment's files, the directory fsyncs."""
    fs = CrashFS(11)
    _workload(fs, 11, [-1])
    dir_ops = fs.dir_fsync_count
    assert dir_ops >= 4  # the root and the storage directory, then one per segment created
    before = fs.ops
    make_dirs_durable(fs, "/other/x")
    assert fs.ops - before == 4  # two mkdirs, two directory fsyncs
