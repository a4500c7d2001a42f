"""``waltz disk``: library functions and the command line."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from waltz.cli.disk import (
    dump_control_file,
    dump_segment,
    offline_max_transaction_id,
    segment_stats,
    verify_segment,
)
from waltz.cli.main import main
from waltz.errors import ConfigError, StorageError
from waltz.protocol.records import Record, ReqId
from waltz.storage.controlfile import CONTROL_FILE_NAME, FLAG_ASSIGNED, FLAG_AVAILABLE, ControlFile
from waltz.storage.partition import PartitionLog
from waltz.storage.segment import SegmentHeader, data_file_name, index_file_name

KEY = uuid.UUID("12345678-1234-5678-1234-567812345678")


def _records(n: int) -> list[Record]:
    return [Record.build(i, ReqId.of(1, 1, 2, i), i, bytes(i % 10 + 1)) for i in range(n)]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    with ControlFile.open_or_create(str(tmp_path), KEY, 3) as cf:
        cf.update(
            2, session_id=5, low_water_mark=9, local_low_water_mark=9, flags=FLAG_AVAILABLE | FLAG_ASSIGNED
        )
    log = PartitionLog.open(str(tmp_path), KEY, 2)
    log.append(_records(10))
    log.flush()
    log.close()
    return tmp_path


def seg_path(store: Path) -> str:
    return str(store / "2" / data_file_name(0))


def test_verify_segment_ok(store: Path) -> None:
    assert verify_segment(seg_path(store)) == []
    assert verify_segment(seg_path(store), 4) == []
    assert verify_segment(seg_path(store), 40) == ["transaction 40 is not in this segment (0..9)"]


def test_verify_segment_lists_failures(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = seg_path(store)
    with open(path, "r+b") as f:
        f.seek(128 + 36)  # the one data byte of transaction 0
        f.write(b"\xee")
    with open(str(store / "2" / index_file_name(0)), "r+b") as f:
        f.seek(128 + 8 * 5)
        f.write((3).to_bytes(8, "big"))
    problems = verify_segment(path)
    assert any("record 0" in p and "checksum" in p for p in problems)
    assert any("transaction 5" in p for p in problems)
    assert main(["disk", "verify-segment", path]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out
    assert main(["disk", "verify-segment", path, "-t", "9"]) == 0


def test_segment_stats(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = segment_stats(seg_path(store))
    assert (s.rows, s.min_data_bytes, s.max_data_bytes) == (10, 1, 10)
    assert s.avg_data_bytes == 5.5
    assert s.median_data_bytes == 5.5
    assert main(["disk", "segment-stats", seg_path(store)]) == 0
    assert "rows: 10" in capsys.readouterr().out


def test_dump_control_file(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ctl = str(store / CONTROL_FILE_NAME)
    lines = dump_control_file(ctl)
    assert f"key: {KEY}" in lines
    assert "partitions: 3" in lines
    assert sum(line.startswith("partition ") for line in lines) == 3
    assigned = dump_control_file(ctl, assigned_only=True)
    assert [line for line in assigned if line.startswith("partition ")] == [
        "partition 2: session id 5, low-water mark 9, local low-water mark 9, assigned True, available True"
    ]
    one = dump_control_file(ctl, partition_id=1)
    assert one[-1].startswith("partition 1: session id -1")
    assert "trim point" not in one[-1]  # said only once a partition was trimmed
    with ControlFile.open_or_create(str(store), KEY, 3) as cf:
        cf.set_trim_point(2, 4)
    assert dump_control_file(ctl, partition_id=2)[-1].endswith("available True, trim point 4")
    with pytest.raises(ConfigError):
        dump_control_file(ctl, partition_id=3)
    assert main(["disk", "dump-control-file", ctl, "-a"]) == 0
    assert "partition 2:" in capsys.readouterr().out
    assert main(["disk", "dump-control-file", ctl, "-p", "7"]) == 2


def test_dump_segment(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = seg_path(store)
    meta = dump_segment(path, metadata=True)
    assert "partition: 2" in meta
    assert "max transaction id: 9" in meta
    recs = dump_segment(path, records=True)
    assert len(recs) == 10
    assert recs[3].startswith("transaction 3: ")
    one = dump_segment(path, transaction_id=2)
    assert one == [f"offset {128 + 41 + 42}: " + recs[2]]
    assert main(["disk", "dump-segment", path, "-m", "-r"]) == 0
    out = capsys.readouterr().out
    assert "first transaction id: 0" in out
    assert "transaction 9:" in out


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / data_file_name(0))
    with pytest.raises(StorageError):
        verify_segment(missing)
    assert main(["disk", "verify-segment", missing]) == 1
    err = capsys.readouterr().err
    assert err.startswith("waltz: error: ")
    assert err.count("\n") == 1
    bad_name = str(tmp_path / "foo.seg")
    assert main(["disk", "segment-stats", bad_name]) == 1
    assert "not a segment data file name" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def _payload_store(tmp_path: Path) -> Path:
    log = PartitionLog.open(str(tmp_path), KEY, 0, segment_size_threshold_bytes=4096)
    datas = [b'{"b": 1, "a": "x"}', "caf\u00e9".encode(), b"\xff\x00"]
    log.append([Record.build(i, ReqId.of(1, 1, 0, i), 0, d) for i, d in enumerate(datas)])
    log.flush()
    log.close()
    return tmp_path / "0" / data_file_name(0)


@pytest.mark.parametrize(
    ("how", "shown"),
    [
        ("hex", ["7b2262223a20312c202261223a202278227d", "636166c3a9", "ff00"]),
        ("utf8", ['{"b": 1, "a": "x"}', "caf\u00e9", "\\xff\x00"]),
        ("json", ['{"a":"x","b":1}', "(not JSON) 636166c3a9", "(not JSON) ff00"]),
    ],
)
def test_dump_segment_shows_payloads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, shown: list[str]
) -> None:
    path = str(_payload_store(tmp_path))
    lines = dump_segment(path, records=True, payload=how)
    assert [line.split("\n  data: ")[1] for line in lines] == shown
    one = dump_segment(path, transaction_id=1, payload=how)
    assert one[-1].endswith(f"data: {shown[1]}")
    # On the command line --payload implies -r.
    assert main(["disk", "dump-segment", path, "--payload", how]) == 0
    out = capsys.readouterr().out
    assert out.count("  data: ") == 3
    assert f"  data: {shown[0]}\n" in out


def test_offline_max_transaction_id_reads_the_files(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert offline_max_transaction_id(store, 2) == 9
    assert main(["storage", "max-transaction-id", "--offline", str(store), "-p", "2"]) == 0
    assert capsys.readouterr().out.strip() == "9"
    # A partition directory without segments holds nothing; a missing one is an error, in one line.
    (store / "1").mkdir()
    assert offline_max_transaction_id(store, 1) == -1
    assert main(["storage", "max-transaction-id", "--offline", str(store), "-p", "0"]) == 2
    assert "no such partition directory" in capsys.readouterr().err
    # Without --offline a running node is asked: its address is needed.
    assert main(["storage", "max-transaction-id", "-p", "0"]) == 2
    assert "give -s/--storage" in capsys.readouterr().err


def test_offline_max_transaction_id_spans_segments(tmp_path: Path) -> None:
    log = PartitionLog.open(str(tmp_path), KEY, 0, segment_size_threshold_bytes=4096)
    for i in range(0, 400, 50):
        log.append(_records(400)[i : i + 50])
    log.flush()
    assert len(log.segment_first_ids) > 1
    log.close()
    assert offline_max_transaction_id(tmp_path, 0) == 399


def test_offline_max_transaction_id_counts_records_after_the_index(tmp_path: Path) -> None:
    """A node killed after an fsync leaves its records durable but its newest index entries unwritten (they
    wait for a checkpoint): the offline max id counts the records that verify after the index's end, as the
    node's recovery will, and not a torn one after them."""
    log = PartitionLog.open(str(tmp_path), KEY, 0)
    log.append(_records(1200)[:1010])
    log.flush()  # no close: the entries after the checkpoint at 1000 stay in memory, as at a kill -9
    assert offline_max_transaction_id(tmp_path, 0) == 1009
    with open(tmp_path / "0" / data_file_name(0), "ab") as f:
        f.write(b"\x00" * 30)  # a torn record after them
    assert offline_max_transaction_id(tmp_path, 0) == 1009
    log.close()


def test_tools_see_a_running_nodes_records_after_the_index(tmp_path: Path) -> None:
    """The writable segment's index entries after the last checkpoint live in the node's memory: verify, stats
    and dump of a running (or killed) node's segment still see those records, verified, and do not call them
    stray bytes after the index."""
    log = PartitionLog.open(str(tmp_path), KEY, 0)
    log.append(_records(1010))
    log.flush()  # no close: the entries after the checkpoint at 1000 stay in memory
    path = str(tmp_path / "0" / data_file_name(0))
    try:
        assert verify_segment(path) == []
        assert verify_segment(path, 1005) == []
        assert segment_stats(path).rows == 1010
        lines = dump_segment(path, records=True)
        assert len(lines) == 1010
        assert lines[-1].startswith("transaction 1009:")
        assert "max transaction id: 1009" in dump_segment(path, metadata=True)
        assert dump_segment(path, transaction_id=1009)[0].startswith("offset ")
        with open(path, "ab") as f:
            f.write(b"\x07" * 30)  # a torn record after them: the node would cut it, verify says so
        assert verify_segment(path) == ["30 bytes after the last indexed record"]
    finally:
        log.close()


@pytest.mark.parametrize("leftover", ["torn_index_header", "headerless_data_file"])
def test_offline_max_transaction_id_skips_a_segment_left_half_created(tmp_path: Path, leftover: str) -> None:
    """A crash during a roll-over can leave the new segment half-created (its index header torn, or only a
    header-less data file): the node removes it when it opens the partition and serves the previous segment's
    records, and the offline max id says the same instead of failing on it."""
    log = PartitionLog.open(str(tmp_path), KEY, 0, segment_size_threshold_bytes=4096)
    log.append(_records(200))
    log.flush()
    last = log.max_transaction_id
    log.close()
    pdir = tmp_path / "0"
    header = SegmentHeader(0, 1, KEY, 0, last + 1).encode()
    if leftover == "torn_index_header":
        (pdir / data_file_name(last + 1)).write_bytes(header)
        (pdir / index_file_name(last + 1)).write_bytes(header[:8] + bytes(range(120)))
    else:
        (pdir / data_file_name(last + 1)).write_bytes(b"\x00" * 40)
    assert offline_max_transaction_id(tmp_path, 0) == last
    with PartitionLog.open(str(tmp_path), KEY, 0, segment_size_threshold_bytes=4096) as log:
        assert log.max_transaction_id == last


def test_offline_max_transaction_id_of_a_node_killed_part_way_through_a_truncate(tmp_path: Path) -> None:
    """A truncate cuts the data file (fsynced) before the index: a node killed in between leaves index
    entries past the data's end, which its recovery drops. The offline max id is the node's, not the
    stale index length."""
    log = PartitionLog.open(str(tmp_path), KEY, 0)
    log.append(_records(1500))
    log.flush()
    seg = log.segment_for(0)
    assert seg is not None
    cut = seg.record_offset(1200)
    log.close()
    with open(tmp_path / "0" / data_file_name(0), "r+b") as f:
        f.truncate(cut)  # truncate(1199) was killed after its first step
    assert offline_max_transaction_id(tmp_path, 0) == 1199
    with PartitionLog.open(str(tmp_path), KEY, 0) as log:
        assert log.max_transaction_id == 1199


def test_tools_read_the_records_before_a_torn_tail(tmp_path: Path) -> None:
    """A node killed (or still writing) leaves a partial record after its last whole one, which its recovery
    cuts: stats and dump read every whole record before it, and verify names the stray bytes."""
    log = PartitionLog.open(str(tmp_path), KEY, 0)
    log.append(_records(1010))
    log.flush()
    path = str(tmp_path / "0" / data_file_name(0))
    try:
        with open(path, "ab") as f:
            f.write(b"\x07" * 30)  # a torn record (zeros alone would be preallocated free space)
        assert segment_stats(path).rows == 1010
        assert len(dump_segment(path, records=True)) == 1010
        assert dump_segment(path, transaction_id=1009)[0].startswith("offset ")
        assert verify_segment(path) == ["30 bytes after the last indexed record"]
    finally:
        log.close()
