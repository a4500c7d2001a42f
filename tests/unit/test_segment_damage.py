"""Index recovery tells damage inside the log from a torn tail: a durable record that does not verify is kept
as a damaged record (never cut with everything after it), a torn tail is still cut (waltz.storage.resync)."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from waltz.errors import CorruptionError
from waltz.protocol.records import Record, ReqId
from waltz.storage.fileio import OS_FS, make_dirs_durable
from waltz.storage.partition import PartitionLog
from waltz.storage.segment import SEGMENT_HEADER_BYTES, Segment, index_file_name
from waltz.testing.crashfs import CrashFS, SimulatedCrash

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
PID = 3
DIR = "/p"


def rec(txn: int, size: int = 24) -> Record:
    data = bytes((txn * 7 + i) & 0xFF for i in range(size))
    return Record.build(txn, ReqId.of(1, 2, PID, txn), txn % 5, data)


def recs(first: int, n: int) -> list[Record]:
    return [rec(i) for i in range(first, first + n)]


def written(fs: CrashFS, n: int = 300, *, close: bool = True) -> Segment:
    """A segment of ``n`` records, flushed; closed (index written) or left as a killed node leaves it."""
    make_dirs_durable(fs, DIR)
    seg = Segment.create(fs, DIR, KEY, PID, 0, clock_ms=lambda: 1)
    seg.append(recs(0, n))
    seg.flush()
    if close:
        seg.close()
    return seg


def reopen(fs: CrashFS, llwm: int = -1) -> Segment:
    return Segment.open(
        fs, DIR, 0, key=KEY, partition_id=PID, writable=True, recover=True, local_low_water_mark=llwm
    )


def flip(fs: CrashFS, seg: Segment, txn: int, at: int) -> None:
    """Flip one byte of ``txn``'s stored record, durably (bit rot)."""
    offset = seg.record_offset(txn) if not seg.closed else SEGMENT_HEADER_BYTES + txn * (40 + 24)
    raw = fs.open(seg.data_path).pread(1, offset + at)
    fs.corrupt(seg.data_path, offset + at, bytes([raw[0] ^ 0x5A]))


@pytest.mark.parametrize(("txn", "at"), [(1, 50), (1, 29), (0, 3), (150, 38), (298, 63)])
def test_a_flipped_byte_inside_the_log_is_kept_as_damage_not_cut(
    txn: int, at: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The backup engineer's case: bit rot in a record of the only segment (data, length field, id, the
    last-but-one record) after a clean stop. Recovery used to cut everything after it as a torn tail."""
    fs = CrashFS()
    seg = written(fs)
    flip(fs, seg, txn, at)
    with caplog.at_level(logging.WARNING):
        seg = reopen(fs)
    assert seg.max_transaction_id == 299
    assert seg.damaged_at_open == [txn]
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert f"transaction(s) {txn}..{txn} do not verify but were durable" in caplog.records[0].getMessage()
    assert "cut" not in caplog.records[0].getMessage().replace("not cut", "")
    with pytest.raises(CorruptionError, match=rf"(record|transaction) {txn}\b"):
        seg.read_records(txn, 1)
    # Everything else is served, and stays so across another restart.
    for lo, hi in ((0, txn), (txn + 1, 300)):
        if hi > lo:
            assert seg.read_records(lo, hi - lo) == recs(lo, hi - lo)
    seg.close()
    again = reopen(fs)
    assert again.max_transaction_id == 299
    assert again.damaged_at_open == [txn]
    again.close()


def test_a_zeroed_page_inside_the_log_keeps_every_record_it_covered() -> None:
    """A lost write: 200 bytes (several records, their headers too) read back as zeros."""
    fs = CrashFS()
    seg = written(fs)
    start = SEGMENT_HEADER_BYTES + 10 * 64 + 5
    fs.corrupt(seg.data_path, start, bytes(200))
    seg = reopen(fs)
    assert seg.max_transaction_id == 299
    assert seg.damaged_at_open == [10, 11, 12, 13]
    assert seg.read_records(14, 300) == recs(14, 286)
    seg.close()


def test_damage_kept_without_index_entries_when_the_local_low_water_mark_covers_it() -> None:
    """A killed node (index entries after the last checkpoint never written): the low-water mark proves the
    records durable. The next record is found from the damaged record's length field, or by its id."""
    for at in (50, 29):  # data, then the length field
        fs = CrashFS()
        seg = written(fs, close=False)
        flip(fs, seg, 1, at)
        fs.crash("apply")
        assert fs.open(f"{DIR}/{index_file_name(0)}").size() == SEGMENT_HEADER_BYTES
        seg = reopen(fs, llwm=299)
        assert seg.max_transaction_id == 299
        assert seg.damaged_at_open == [1]
        assert seg.read_records(2, 300) == recs(2, 298)
        seg.close()


def test_a_torn_tail_is_still_cut() -> None:
    """Unflushed records after the last durable one (not indexed, above the low-water mark) that do not verify
    are a torn tail, even when a later write survived the crash and verifies."""
    fs = CrashFS()
    seg = written(fs, 10, close=False)
    seg.sync()  # 0..9 indexed
    seg.append(recs(10, 5))
    seg.append(recs(15, 5))
    offset = seg.record_offset(11)
    fs.crash("apply")
    fs.corrupt(seg.data_path, offset + 45, b"\x00\x01")  # as a torn write of 11 would leave it
    seg = reopen(fs, llwm=9)
    assert seg.max_transaction_id == 10
    assert seg.damaged_at_open == []
    assert seg.verify() == []
    seg.close()


def test_a_damaged_record_at_the_end_of_the_durable_log_is_kept() -> None:
    fs = CrashFS()
    seg = written(fs)
    flip(fs, seg, 299, 45)
    seg = reopen(fs)
    assert seg.max_transaction_id == 299
    assert seg.damaged_at_open == [299]
    assert seg.size_bytes == SEGMENT_HEADER_BYTES + 300 * 64
    seg.close()


def test_partition_log_reports_the_damage_and_a_repair_heals_it(tmp_path: Path) -> None:
    """Real files: the log keeps the damaged record across a restart, names it, and takes a good copy."""
    with PartitionLog.open(str(tmp_path), KEY, PID, fs=OS_FS) as plog:
        for i in range(0, 300, 30):
            plog.append(recs(i, 30))
            plog.flush()
    path = tmp_path / str(PID) / "0000000000000000000.seg"
    raw = bytearray(path.read_bytes())
    raw[SEGMENT_HEADER_BYTES + 64 + 50] ^= 0xFF
    path.write_bytes(bytes(raw))
    with PartitionLog.open(str(tmp_path), KEY, PID, fs=OS_FS) as plog:
        assert plog.max_transaction_id == 299
        assert plog.damaged_at_open == [1]
        assert plog.read_records(2, 500) == recs(2, 298)
        assert plog.repair([rec(1)]) == [1]
        assert plog.read_records(0, 500) == recs(0, 300)
    with PartitionLog.open(str(tmp_path), KEY, PID, fs=OS_FS) as plog:
        assert plog.damaged_at_open == []
        seg = plog.segment_for(0)
        assert seg is not None
        assert seg.verify() == []


def test_an_index_entry_names_only_a_durable_record() -> None:
    """What recovery relies on: a sync writes the index entries waiting only after the data file's fsync,
    so a crash at that fsync (the first thing a sync does) leaves no entry for the records it would cover."""
    fs = CrashFS()
    seg = written(fs, 20, close=False)
    seg.append(recs(20, 5))
    fs.arm(0)
    with pytest.raises(SimulatedCrash):
        seg.sync()
    fs.crash("apply")  # even every issued write applied: the index write was not issued yet
    assert fs.open(f"{DIR}/{index_file_name(0)}").size() == SEGMENT_HEADER_BYTES


def test_a_killed_node_keeps_damage_in_records_it_flushed() -> None:
    """After a flush the node writes the index entries of the flushed records (not fsynced): a process kill
    keeps them, so bit rot in a record that was acknowledged is kept as damage even with no checkpoint and
    no low-water mark above it. Records appended after the last flush are still a torn tail."""
    fs = CrashFS()
    make_dirs_durable(fs, "/s")
    plog = PartitionLog.open("/s", KEY, PID, fs=fs)
    for i in range(0, 300, 30):
        plog.append(recs(i, 30))
        plog.flush()
        plog.write_flushed_index()
    plog.append(recs(300, 5))  # not flushed: never acknowledged
    seg = plog.segment_for(0)
    assert seg is not None
    offset = seg.record_offset(1)
    fs.crash("apply")  # a kill: the page cache survives, the process does not
    fs.corrupt(seg.data_path, offset + 50, b"\xee")
    with PartitionLog.open("/s", KEY, PID, fs=fs) as plog:
        assert plog.max_transaction_id == 304
        assert plog.damaged_at_open == [1]
        assert plog.read_records(2, 500) == recs(2, 303)


def test_indexed_records_that_read_as_zeros_at_the_end_are_reported_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lost write of the last durable records (zeros where the index says records were, nothing after):
    nothing to keep, but the loss is reported (an ERROR and ``lost_at_open``: the node marks the replica
    damaged), never taken for a torn tail."""
    fs = CrashFS()
    seg = written(fs)
    fs.corrupt(seg.data_path, SEGMENT_HEADER_BYTES + 290 * 64, bytes(10 * 64))
    with caplog.at_level(logging.WARNING):
        seg = reopen(fs)
    assert seg.max_transaction_id == 289
    assert seg.lost_at_open is not None
    assert "transactions 290..299 were durable" in seg.lost_at_open
    assert any(r.levelname == "ERROR" and "read as zeros: lost" in r.getMessage() for r in caplog.records)
    seg.close()
    # A torn tail of records never flushed (not indexed) is still no loss.
    fs = CrashFS()
    seg = written(fs, 10, close=False)
    seg.sync()
    seg.append(recs(10, 5))
    offset = seg.record_offset(10)
    fs.crash("apply")
    fs.corrupt(seg.data_path, offset, bytes(5 * 64))
    seg = reopen(fs)
    assert seg.max_transaction_id == 9
    assert seg.lost_at_open is None
    seg.close()
