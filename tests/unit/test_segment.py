"""Segments: golden bytes, appends, reads that verify, truncation and index recovery."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

import pytest

from waltz.errors import CorruptionError, FormatVersionError, StorageError, TransactionOutOfOrderError
from waltz.protocol import storage as st
from waltz.protocol.record_run import RecordRun
from waltz.protocol.records import Record, ReqId
from waltz.protocol.storage import WireRecordList
from waltz.storage.fileio import make_dirs_durable
from waltz.storage.segment import (
    CHECKPOINT_INTERVAL,
    SEGMENT_HEADER_BYTES,
    RecordCorruptionError,
    Segment,
    SegmentHeader,
    append_wire_run,
    data_file_name,
    encode_record,
    index_file_name,
    parse_segment_name,
)
from waltz.testing.crashfs import CrashFS

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
PID = 3
DIR = "/p"


def rec(txn: int, size: int = 16) -> Record:
    data = bytes((txn * 7 + i) & 0xFF for i in range(size))
    return Record.build(txn, ReqId.of(1, 2, PID, txn), txn % 5, data)


def recs(first: int, n: int, size: int = 16) -> list[Record]:
    return [rec(i, size) for i in range(first, first + n)]


def new_segment(fs: CrashFS, first: int = 0) -> Segment:
    make_dirs_durable(fs, DIR)
    return Segment.create(fs, DIR, KEY, PID, first, clock_ms=lambda: 1_600_000_000_000)


def reopen(fs: CrashFS, first: int = 0, *, recover: bool = True) -> Segment:
    return Segment.open(fs, DIR, first, key=KEY, partition_id=PID, writable=recover, recover=recover)


def test_file_names() -> None:
    assert data_file_name(0) == "0000000000000000000.seg"
    assert index_file_name(1234) == "0000000000000001234.idx"
    assert parse_segment_name("0000000000000001234.idx") == (1234, ".idx")
    assert parse_segment_name("1234.seg") is None
    assert parse_segment_name("0000000000000001234.tmp") is None


def test_header_golden_bytes() -> None:
    raw = SegmentHeader(0, 1_600_000_000_000, KEY, 3, 1000).encode()
    assert raw == (
        bytes.fromhex("00000000")  # version
        + bytes.fromhex("00000174876e8000")  # creation time ms
        + bytes.fromhex("0011223344556677")  # key msb
        + bytes.fromhex("8899aabbccddeeff")  # key lsb
        + bytes.fromhex("00000003")  # partition id
        + bytes.fromhex("00000000000003e8")  # first transaction id
        + bytes(88)
    )
    fs = CrashFS()
    seg = new_segment(fs, 1000)
    for path in (seg.data_path, seg.index_path):
        assert fs.open(path).pread(200, 0) == SegmentHeader(0, 1_600_000_000_000, KEY, PID, 1000).encode()


def test_record_golden_bytes() -> None:
    r = Record.build(42, ReqId(0x0000000100000002, 0x0000000300000004), 7, b"abc")
    assert r.checksum == 0x352441C2
    assert encode_record(r) == bytes.fromhex(
        "000000000000002a"  # transaction id
        "0000000100000002"  # reqId msb
        "0000000300000004"  # reqId lsb
        "00000007"  # header
        "00000003"  # data length
        "352441c2"  # client CRC-32 of the data
        "616263"  # data
        "2d44ccf1"  # CRC-32 of the 36 header bytes plus the data
    )


def test_append_layout_and_index() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    batch = recs(0, 3, size=10)
    assert seg.append(batch) == 3
    data = fs.open(seg.data_path).pread(10_000, 0)
    assert data[SEGMENT_HEADER_BYTES:] == b"".join(encode_record(r) for r in batch)
    # The index entries wait for the next checkpoint (or close, truncation, sync): nothing waits for them.
    assert fs.open(seg.index_path).pread(10_000, SEGMENT_HEADER_BYTES) == b""
    assert seg.record_offset(2) == 228
    seg.flush()
    assert fs.open(seg.index_path).pread(10_000, SEGMENT_HEADER_BYTES) == b""
    seg.sync()
    index = fs.open(seg.index_path).pread(10_000, SEGMENT_HEADER_BYTES)
    assert struct.unpack(">3q", index) == (128, 178, 228)
    assert seg.max_transaction_id == 2
    assert seg.size_bytes == 128 + 3 * 50


def test_append_and_read_back() -> None:
    fs = CrashFS()
    seg = new_segment(fs, 100)
    batch = recs(100, 50)
    seg.append(batch[:20])
    seg.append(batch[20:])
    assert seg.read_record(100) == batch[0]
    assert seg.read_record(149) == batch[49]
    assert seg.read_record(150) is None
    assert seg.read_record(99) is None
    assert seg.read_header(120) == batch[20].header_only()
    assert seg.read_records(110, 5) == batch[10:15]
    assert seg.read_records(140, 100) == batch[40:]
    assert seg.read_headers(145, 100) == [r.header_only() for r in batch[45:]]
    assert seg.read_records(150, 10) == []
    assert seg.read_records(100, 0) == []
    # max_bytes bounds the load but always returns at least one record.
    assert seg.read_records(100, 50, max_bytes=1) == batch[:1]
    assert seg.read_records(100, 50, max_bytes=3 * 56) == batch[:3]


def test_append_rejects_gaps_and_bad_checksums() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    seg.append(recs(0, 2))
    with pytest.raises(TransactionOutOfOrderError):
        seg.append(recs(3, 1))
    with pytest.raises(TransactionOutOfOrderError):
        seg.append([rec(2), rec(4)])
    bad = rec(2)._replace(checksum=rec(2).checksum ^ 1)
    with pytest.raises(CorruptionError, match="does not match its checksum"):
        seg.append([rec(2), bad._replace(transaction_id=3)])
    # Nothing of a rejected batch was written.
    assert seg.max_transaction_id == 1
    assert seg.size_bytes == 128 + 2 * 56


def test_append_stops_at_threshold() -> None:
    fs = CrashFS()
    seg = new_segment(fs, 990)
    # The record that passes the threshold is the last one written.
    assert seg.append(recs(990, 5), size_threshold_bytes=128 + 56 + 1) == 2
    assert seg.append(recs(992, 5), size_threshold_bytes=128 + 56 + 1) == 0


def test_checkpoint_fsyncs_before_the_checkpoint_id() -> None:
    fs = CrashFS()
    seg = new_segment(fs, 990)
    seg.append(recs(990, 5))
    syncs = fs.fsync_count
    writes_before = fs.ops
    # A batch crossing id 1000: the part below is written, both files fsynced, then the rest written.
    assert seg.append(recs(995, 20)) == 20
    assert fs.fsync_count == syncs + 2
    assert fs.ops == writes_before + 5  # the data below, the index entries waiting, 2 fsyncs, the data above
    assert seg.read_records(990, 100) == recs(990, 25)
    # Starting a segment exactly at a checkpoint needs no checkpoint.
    seg2 = new_segment(fs, 2000)
    syncs = fs.fsync_count
    seg2.append(recs(2000, 3))
    assert fs.fsync_count == syncs


def test_corrupt_record_detected_on_read() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    seg.append(recs(0, 5))
    seg.flush()
    offset = seg.record_offset(2)
    fs.corrupt(seg.data_path, offset + 40, b"\xff")  # a data byte
    with pytest.raises(CorruptionError, match=r"record 2 .*checksum mismatch"):
        seg.read_record(2)
    with pytest.raises(CorruptionError):
        seg.read_records(0, 5)
    assert seg.read_records(0, 2) == recs(0, 2)
    assert any("record 2" in p for p in seg.verify())
    seg.sync()  # the index entries wait in memory until then
    fs.corrupt(seg.index_path, SEGMENT_HEADER_BYTES + 8 * 4, struct.pack(">q", 10**9))
    with pytest.raises(CorruptionError, match="bad index entry"):
        seg.read_record(4)


def test_truncate() -> None:
    fs = CrashFS()
    seg = new_segment(fs, 10)
    seg.append(recs(10, 10))
    seg.truncate(14)
    assert seg.max_transaction_id == 14
    assert seg.read_record(15) is None
    assert seg.size_bytes == 128 + 5 * 56
    seg.append(recs(15, 2, size=3))
    assert seg.read_records(10, 100) == [*recs(10, 5), *recs(15, 2, size=3)]
    seg.truncate(9)
    assert seg.max_transaction_id == 9
    assert seg.size_bytes == 128
    with pytest.raises(StorageError):
        seg.truncate(5)
    # Durable: a crash right after keeps the truncation.
    fs.crash("apply")
    seg2 = reopen(fs, 10)
    assert seg2.max_transaction_id == 9


def test_header_mismatch_on_open() -> None:
    fs = CrashFS()
    new_segment(fs).close()
    with pytest.raises(CorruptionError, match="cluster key"):
        Segment.open(fs, DIR, 0, key=uuid.UUID(int=5), partition_id=PID)
    with pytest.raises(CorruptionError, match="partition"):
        Segment.open(fs, DIR, 0, key=KEY, partition_id=PID + 1)
    fs.corrupt(f"{DIR}/{index_file_name(0)}", 0, b"\x00\x00\x00\x09")
    # An unknown version is a newer release's file (or not ours): refused, not damage to repair.
    with pytest.raises(FormatVersionError, match=r"segment format version 9, .* reads version 0"):
        reopen(fs)


def test_read_only_segment_refuses_writes() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    seg.append(recs(0, 3))
    seg.close()
    ro = reopen(fs, recover=False)
    assert ro.read_records(0, 10) == recs(0, 3)
    with pytest.raises(StorageError, match="read-only"):
        ro.append(recs(3, 1))
    ro.close()
    with pytest.raises(StorageError, match="closed"):
        ro.read_record(0)


# ----------------------------------------------------------------------------------------------- recovery


def test_recovery_rebuilds_lost_index_entries() -> None:
    """Data fsynced, index entries after the last checkpoint lost (SegmentTest.testIndexRecovery)."""
    fs = CrashFS()
    seg = new_segment(fs)
    all_recs = recs(0, 1500, size=8)
    for i in range(0, 1500, 100):
        seg.append(all_recs[i : i + 100])
        seg.flush()
    fs.crash("drop")  # index writes after the checkpoint at 1000 vanish
    index_size = fs.open(f"{DIR}/{index_file_name(0)}").size()
    assert index_size == SEGMENT_HEADER_BYTES + 8 * 1000
    seg2 = reopen(fs)
    assert seg2.max_transaction_id == 1499
    assert seg2.read_records(990, 1000) == all_recs[990:]
    assert seg2.verify() == []


def test_recovery_cuts_incomplete_write() -> None:
    """A batch torn in the middle (SegmentTest.testIncompleteWrite)."""
    fs = CrashFS(3)
    seg = new_segment(fs)
    seg.append(recs(0, 10))
    seg.sync()
    seg.append(recs(10, 10))
    fs.crash("torn")
    seg2 = reopen(fs)
    assert 9 <= seg2.max_transaction_id < 20
    n = seg2.max_transaction_id + 1
    assert seg2.read_records(0, 100) == recs(0, n)
    assert seg2.size_bytes == 128 + 56 * n
    assert fs.open(seg2.index_path).size() == 128 + 8 * n


def test_recovery_cuts_dirty_write() -> None:
    """Garbage after the last good record (SegmentTest.testDirtyWrite)."""
    fs = CrashFS(4)
    seg = new_segment(fs)
    seg.append(recs(0, 10))
    seg.sync()
    seg.append(recs(10, 10))
    fs.crash("garble")
    seg2 = reopen(fs)
    assert seg2.max_transaction_id == 9
    assert seg2.verify() == []


def test_recovery_with_garbage_index_falls_back_to_earlier_checkpoint() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    seg.append(recs(0, 1000, size=4))
    seg.append(recs(1000, 1001, size=4))
    seg.append(recs(2001, 10, size=4))
    seg.sync()
    seg.close()
    # Checkpoint entry 1999 points nowhere: recovery must try 999 and rescan from there.
    fs.corrupt(f"{DIR}/{index_file_name(0)}", SEGMENT_HEADER_BYTES + 8 * 1999, struct.pack(">q", 5))
    seg2 = reopen(fs)
    assert seg2.max_transaction_id == 2010
    assert seg2.verify() == []


def test_recovery_of_empty_segment() -> None:
    fs = CrashFS()
    new_segment(fs, 5).close()
    seg = reopen(fs, 5)
    assert seg.max_transaction_id == 4
    assert seg.append(recs(5, 2)) == 2


def test_real_files(tmp_path: Path) -> None:
    from waltz.storage.fileio import OS_FS

    d = str(tmp_path)
    seg = Segment.create(OS_FS, d, KEY, PID, 0)
    seg.append(recs(0, 1200, size=30))
    seg.flush()
    seg.close()
    seg2 = Segment.open(OS_FS, d, 0, key=KEY, partition_id=PID, writable=True, recover=True)
    assert seg2.max_transaction_id == 1199
    assert seg2.read_record(1100) == rec(1100, 30)
    seg2.close()
    assert CHECKPOINT_INTERVAL == 1000


def test_read_run_returns_the_stored_bytes() -> None:
    fs = CrashFS()
    seg = new_segment(fs, 100)
    batch = recs(100, 50)
    seg.append(batch)
    count, run = seg.read_run(110, 5)
    assert count == 5
    assert run == b"".join(encode_record(r) for r in batch[10:15])
    assert RecordRun(110, count, run).records() == batch[10:15]
    assert seg.read_run(140, 100)[0] == 10
    assert seg.read_run(150, 10) == (0, b"")
    assert seg.read_run(99, 10) == (0, b"")
    assert seg.read_run(100, 0) == (0, b"")
    # max_bytes bounds the load but always returns at least one record.
    assert seg.read_run(100, 50, max_bytes=1)[0] == 1
    assert seg.read_run(100, 50, max_bytes=3 * 56)[0] == 3


def test_read_run_refuses_a_damaged_record_and_names_it() -> None:
    fs = CrashFS()
    seg = new_segment(fs)
    seg.append(recs(0, 3))
    seg.flush()
    fs.corrupt(seg.data_path, seg.record_offset(1) + 40, b"\xff")  # a data byte
    # The node checks each record right after its read, so a damaged copy never reaches a reader.
    with pytest.raises(RecordCorruptionError, match="record 1") as caught:
        seg.read_run(0, 3)
    assert caught.value.transaction_id == 1
    # The record before the damage is still served.
    count, run = seg.read_run(0, 1)
    assert count == 1
    assert RecordRun(0, count, run).records() == recs(0, 1)


@pytest.mark.parametrize(("record", "at"), [(0, 40), (13, 40), (19, 0), (7, 28), (5, 55)])
def test_read_run_of_records_of_one_size_refuses_damage_anywhere_and_names_the_record(
    record: int, at: int
) -> None:
    """A run of records of one size is checked without a loop over its records (see _check_run); damage in
    any one of them (data, id, length, record checksum) is still refused, naming the record, as the loop
    does (the tests above use runs too short for that path)."""
    fs = CrashFS()
    seg = new_segment(fs)
    batch = recs(0, 20)
    seg.append(batch)
    seg.flush()
    count, run = seg.read_run(0, 20)
    assert (count, RecordRun(0, count, run).records()) == (20, batch)
    offset = seg.record_offset(record) + at
    fs.corrupt(seg.data_path, offset, bytes([run[offset - seg.record_offset(0)] ^ 0x24]))
    with pytest.raises(RecordCorruptionError, match=rf"(record|transaction) {record}\b") as caught:
        seg.read_run(0, 20)
    assert caught.value.transaction_id == record


def wire_list(records: list[Record]) -> WireRecordList:
    msg = st.decode(st.encode(st.AppendRequest(1, 1, PID, records, False)))
    assert isinstance(msg, st.AppendRequest)
    assert isinstance(msg.records, WireRecordList)
    return msg.records


def test_wire_run_is_the_stored_layout() -> None:
    """The append path builds the stored run straight from a request's bytes: the same bytes encode_run
    gives, split where each record ends, across requests of one group."""
    first, second = recs(5, 3, size=40), recs(8, 2, size=0)
    parts: list[bytes | memoryview] = []
    ends: list[int] = []
    append_wire_run(parts, ends, wire_list(first), 5)
    append_wire_run(parts, ends, wire_list(second), 8)
    run = b"".join(parts)
    assert run == b"".join(encode_record(r) for r in first + second)
    assert ends == [80, 160, 240, 280, 320]
    seg = new_segment(CrashFS(), 5)
    assert seg.append_run(run, ends) == 5
    assert seg.read_records(5, 10) == first + second


@pytest.mark.parametrize("count", [3, 30, 300])
@pytest.mark.parametrize("size", [0, 16, 512])
def test_wire_run_of_records_of_one_size_is_the_stored_layout(count: int, size: int) -> None:
    """Requests of records of one size (checked and converted in bulk from 4 records on) give the bytes and
    ends the per-record loop gives, after records of another size in the same group."""
    lead, batch = recs(0, 2, size=7), recs(2, count, size=size)
    wire = wire_list(batch)
    assert wire.record_bytes == (36 + size if count >= 4 else 0)
    parts: list[bytes | memoryview] = []
    ends: list[int] = []
    append_wire_run(parts, ends, wire_list(lead), 0)
    append_wire_run(parts, ends, wire, 2)
    assert b"".join(parts) == b"".join(encode_record(r) for r in lead + batch)
    assert ends == [47, 94] + [94 + (40 + size) * (k + 1) for k in range(count)]


@pytest.mark.parametrize("count", [3, 30, 300])
@pytest.mark.parametrize("where", [0, 1, -1])
@pytest.mark.parametrize("bad", ["gap", "checksum", "torn"])
def test_wire_run_refuses_a_bad_request_and_keeps_the_group(count: int, where: int, bad: str) -> None:
    """A record out of sequence, whose data does not match its checksum, or torn (its data cut short,
    the checksum being the next bytes) is refused with the error of the per-record loop, naming it, and
    nothing of its request joins the group: for requests checked record by record and in bulk alike."""
    parts: list[bytes | memoryview] = []
    ends: list[int] = []
    append_wire_run(parts, ends, wire_list(recs(0, 2)), 0)
    kept = (b"".join(parts), list(ends))
    wrong = recs(2, count)
    txn = wrong[where].transaction_id
    error: type[Exception] = CorruptionError
    if bad == "gap":
        wrong[where] = rec(txn + 7)
        error, message = TransactionOutOfOrderError, f"expected {txn}, got {txn + 7}"
    elif bad == "checksum":
        wrong[where] = wrong[where]._replace(checksum=wrong[where].checksum ^ 1)
        message = f"transaction {txn}: data does not match its checksum"
    else:
        data = wrong[where].data
        wrong[where] = wrong[where]._replace(
            data=data[:12] + data[16:] + wrong[where].checksum.to_bytes(4, "big")
        )
        message = f"transaction {txn}: data does not match its checksum"
    with pytest.raises(error, match=message):
        append_wire_run(parts, ends, wire_list(wrong), 2)
    assert (b"".join(parts), ends) == kept


def test_append_run_splits_at_the_threshold_and_the_checkpoint() -> None:
    fs = CrashFS()
    seg = new_segment(fs, 995)
    run = b"".join(encode_record(r) for r in recs(995, 10))
    ends = [56 * (k + 1) for k in range(10)]
    syncs = fs.fsync_count
    # Stops after the record that passes the threshold (the 7th), fsyncing both files before id 1000.
    assert seg.append_run(run, ends, size_threshold_bytes=128 + 56 * 6 + 1) == 7
    assert fs.fsync_count == syncs + 2
    assert seg.append_run(run, ends, 7) == 3
    assert seg.read_records(995, 20) == recs(995, 10)


@pytest.mark.parametrize("damage", ["swap", "duplicate", "swap_bodies", "zero_same_bytes"])
def test_read_run_of_records_of_one_size_refuses_damage_in_two_records(damage: str) -> None:
    """Damage spread over two records of a run of one record size (records swapped or duplicated on disk,
    record bodies moved under their ids, the same bytes of two records zeroed as by a torn page) is refused
    by the fast check as by the loop, naming the first damaged record."""
    fs = CrashFS()
    seg = new_segment(fs)
    batch = recs(0, 20)
    seg.append(batch)
    seg.flush()
    _, run = seg.read_run(0, 20)
    base = seg.record_offset(0)
    stride = seg.record_offset(1) - base
    i, j = 4, 11
    a, b = run[i * stride : (i + 1) * stride], run[j * stride : (j + 1) * stride]
    at_i, at_j = seg.record_offset(i), seg.record_offset(j)
    if damage == "swap":
        fs.corrupt(seg.data_path, at_i, b)
        fs.corrupt(seg.data_path, at_j, a)
    elif damage == "duplicate":
        fs.corrupt(seg.data_path, at_j, a)
    elif damage == "swap_bodies":
        fs.corrupt(seg.data_path, at_i + 8, b[8:])
        fs.corrupt(seg.data_path, at_j + 8, a[8:])
    else:
        fs.corrupt(seg.data_path, at_i + 30, bytes(stride - 30))
        fs.corrupt(seg.data_path, at_j + 30, bytes(stride - 30))
    first_damaged = j if damage == "duplicate" else i
    with pytest.raises(RecordCorruptionError, match=rf"(record|transaction) {first_damaged}\b") as caught:
        seg.read_run(0, 20)
    assert caught.value.transaction_id == first_damaged
