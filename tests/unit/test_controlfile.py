"""The control file: golden bytes, dual-struct updates, torn-write rollback, key checks, locking."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from waltz.errors import ClusterKeyMismatchError, CorruptionError, StorageError
from waltz.storage.controlfile import (
    CONTROL_FILE_NAME,
    FLAG_ASSIGNED,
    FLAG_AVAILABLE,
    HEADER_BYTES,
    PARTITION_INFO_BYTES,
    TRIM_INFO_BYTES,
    ControlFile,
    ControlHeader,
    PartitionInfo,
    encode_struct,
    encode_trim_struct,
    fresh_partition_info_bytes,
    fresh_trim_info_bytes,
    read_control_file,
    read_control_file_with_trims,
)
from waltz.testing.crashfs import CrashFS, SimulatedCrash

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
CLOCK_MS = 1_600_000_000_000  # 0x174876E8000


def _open(fs: CrashFS, key: uuid.UUID = KEY, n: int = 4) -> ControlFile:
    return ControlFile.open_or_create("/store", key, n, fs=fs, clock_ms=lambda: CLOCK_MS)


def test_header_golden_bytes() -> None:
    raw = ControlHeader(0, CLOCK_MS, KEY, 7).encode()
    expected = (
        bytes.fromhex("00000000")  # version
        + bytes.fromhex("00000174876e8000")  # creation time ms
        + bytes.fromhex("0011223344556677")  # key msb
        + bytes.fromhex("8899aabbccddeeff")  # key lsb
        + bytes.fromhex("00000007")  # partitions
        + bytes(96)
    )
    assert raw == expected
    assert len(raw) == HEADER_BYTES
    assert ControlHeader.decode(raw) == ControlHeader(0, CLOCK_MS, KEY, 7)


def test_fresh_partition_info_golden_bytes() -> None:
    raw = fresh_partition_info_bytes(3)
    minus_one = "ffffffffffffffff" * 3
    expected = bytes.fromhex(
        "00000003"
        + minus_one
        + "00000001"  # AVAILABLE
        + "ffffffff"  # sequence -1
        + "58d1a22d"  # CRC-32 of the 32 bytes before
        + minus_one
        + "00000001"
        + "00000000"  # sequence 0
        + "866a82ce"
    )
    assert raw == expected
    assert len(raw) == PARTITION_INFO_BYTES


def test_struct_golden_bytes() -> None:
    raw = encode_struct(PartitionInfo(7, 1000, 5, FLAG_AVAILABLE | FLAG_ASSIGNED), 1)
    assert raw == bytes.fromhex("000000000000000700000000000003e800000000000000050000000500000001e7d55db6")


def test_create_then_reopen() -> None:
    fs = CrashFS()
    with _open(fs) as cf:
        assert cf.key == KEY
        assert cf.num_partitions == 4
        assert cf.creation_time_ms == CLOCK_MS
        assert cf.partition_info(2) == PartitionInfo(-1, -1, -1, FLAG_AVAILABLE)
        assert cf.sequence_number(2) == 0
        cf.update(2, session_id=9, low_water_mark=100, local_low_water_mark=90)
        cf.set_assigned(2, True)
    # The file survives a crash right after close: updates were fsynced.
    fs.crash("drop")
    with _open(fs) as cf:
        info = cf.partition_info(2)
        assert info == PartitionInfo(9, 100, 90, FLAG_AVAILABLE | FLAG_ASSIGNED)
        assert info.assigned
        assert info.available
        assert cf.sequence_number(2) == 2
        assert cf.partition_info(1) == PartitionInfo()
        cf.set_available(2, False)
        assert not cf.partition_info(2).available


def test_update_alternates_structs() -> None:
    fs = CrashFS()
    with _open(fs) as cf:
        f = fs.open("/store/" + CONTROL_FILE_NAME, read_only=True)
        base = HEADER_BYTES + PARTITION_INFO_BYTES * 1
        before = f.pread(PARTITION_INFO_BYTES, base)
        cf.update(1, session_id=1)
        after1 = f.pread(PARTITION_INFO_BYTES, base)
        # First update writes struct A (the one with sequence -1), leaving B untouched.
        assert after1[40:] == before[40:]
        assert after1[4:40] == encode_struct(PartitionInfo(session_id=1), 1)
        cf.update(1, session_id=2)
        after2 = f.pread(PARTITION_INFO_BYTES, base)
        assert after2[4:40] == after1[4:40]
        assert after2[40:] == encode_struct(PartitionInfo(session_id=2), 2)
        f.close()


@pytest.mark.parametrize("seed", range(20))
def test_torn_update_rolls_back_exactly_one(seed: int) -> None:
    fs = CrashFS(seed)
    cf = _open(fs)
    cf.update(0, session_id=1, low_water_mark=10)
    cf.update(0, session_id=2, low_water_mark=20)
    # Crash at the fsync of the third update: its struct write is pending and gets garbled or torn.
    fs.arm(1)
    with pytest.raises(SimulatedCrash):
        cf.update(0, session_id=3, low_water_mark=30)
    fs.crash("garble" if seed % 2 == 0 else "torn")
    with _open(fs) as cf2:
        info = cf2.partition_info(0)
        # A torn write may by chance leave the struct whole (a tear at a point past its end is impossible,
        # but random tail bytes never match the checksum); either way at most one update is lost.
        assert info.session_id in (2, 3)
        if info.session_id == 2:
            assert info.low_water_mark == 20
            assert cf2.sequence_number(0) == 2


def test_garbled_update_rolls_back_and_next_update_reuses_slot() -> None:
    fs = CrashFS(1)
    cf = _open(fs)
    cf.update(0, session_id=1)
    fs.arm(1)
    with pytest.raises(SimulatedCrash):
        cf.update(0, session_id=2)
    fs.crash("garble")
    with _open(fs) as cf2:
        assert cf2.partition_info(0).session_id == 1
        cf2.update(0, session_id=5)
    with _open(fs) as cf3:
        assert cf3.partition_info(0).session_id == 5
        assert cf3.sequence_number(0) == 2


def test_applied_update_survives_crash_before_fsync() -> None:
    fs = CrashFS(1)
    cf = _open(fs)
    fs.arm(1)
    with pytest.raises(SimulatedCrash):
        cf.update(0, session_id=2)
    fs.crash("apply")
    with _open(fs) as cf2:
        assert cf2.partition_info(0).session_id == 2


def test_both_structs_corrupt_takes_down_only_that_partition() -> None:
    fs = CrashFS()
    with _open(fs) as cf:
        cf.update(1, session_id=7, flags=FLAG_AVAILABLE | FLAG_ASSIGNED)
    path = "/store/" + CONTROL_FILE_NAME
    fs.corrupt(path, HEADER_BYTES + 4 + 3, b"\x55")
    fs.corrupt(path, HEADER_BYTES + 40 + 3, b"\x55")
    with pytest.raises(CorruptionError, match="partition info 0 corrupted"):
        read_control_file(path, fs)  # tools still see the damage as an error
    with _open(fs) as cf:
        assert list(cf.damaged) == [0]
        assert "both structs fail their checksum" in cf.damaged[0]
        assert not cf.partition_info(0).assigned
        assert cf.partition_info(1).session_id == 7  # the others are untouched
        with pytest.raises(CorruptionError, match="remove the replica"):
            cf.update(0, session_id=1)
        assert cf.reset(0) == PartitionInfo()
        assert cf.damaged == {}
        cf.update(0, session_id=3)
    with _open(fs) as cf:
        assert cf.damaged == {}
        assert cf.partition_info(0).session_id == 3


def test_one_struct_corrupt_uses_other() -> None:
    fs = CrashFS()
    cf = _open(fs)
    cf.update(0, session_id=1)
    cf.close()
    fs.corrupt("/store/" + CONTROL_FILE_NAME, HEADER_BYTES + 4 + 3, b"\x55")  # struct A holds the update
    with _open(fs) as cf2:
        assert cf2.partition_info(0) == PartitionInfo()


def test_equal_sequence_numbers_are_corruption() -> None:
    fs = CrashFS()
    _open(fs).close()
    fs.corrupt("/store/" + CONTROL_FILE_NAME, HEADER_BYTES + 4, encode_struct(PartitionInfo(), 0))
    with _open(fs) as cf:
        assert "sequence 0" in cf.damaged[0]


def test_wrong_size_is_corruption() -> None:
    fs = CrashFS()
    _open(fs).close()
    fs.open("/store/" + CONTROL_FILE_NAME).truncate(HEADER_BYTES + 10)
    with pytest.raises(CorruptionError, match="bytes, expected"):
        _open(fs)


def test_key_and_partition_count_mismatch() -> None:
    fs = CrashFS()
    _open(fs).close()
    with pytest.raises(ClusterKeyMismatchError, match="cluster key"):
        _open(fs, key=uuid.UUID(int=1))
    with pytest.raises(ClusterKeyMismatchError, match="partitions"):
        _open(fs, n=5)
    # A refused open releases its lock.
    _open(fs).close()


def test_bad_arguments() -> None:
    fs = CrashFS()
    with pytest.raises(StorageError):
        _open(fs, n=0)
    with _open(fs) as cf:
        with pytest.raises(StorageError, match="out of range"):
            cf.partition_info(4)
        with pytest.raises(StorageError, match="unknown partition flags"):
            cf.update(0, flags=16)
        with pytest.raises(StorageError, match="out of range"):
            cf.update(0, session_id=2**63)
    with pytest.raises(StorageError, match="closed"):
        cf.partition_info(0)


def test_second_opener_is_refused_by_the_lock_fake() -> None:
    fs = CrashFS()
    cf = _open(fs)
    with pytest.raises(StorageError, match="locked by another process"):
        _open(fs)
    cf.close()
    _open(fs).close()


def test_real_files_and_flock(tmp_path: Path) -> None:
    d = str(tmp_path)
    cf = ControlFile.open_or_create(d, KEY, 3)
    try:
        cf.update(1, session_id=4, flags=FLAG_AVAILABLE | FLAG_ASSIGNED)
        with pytest.raises(StorageError, match="locked by another process"):
            ControlFile.open_or_create(d, KEY, 3)
        # Tools read without the lock while the node holds it.
        header, infos = read_control_file(os.path.join(d, CONTROL_FILE_NAME))
        assert header.num_partitions == 3
        assert infos[1].session_id == 4
        assert os.path.getsize(os.path.join(d, CONTROL_FILE_NAME)) == HEADER_BYTES + 3 * (
            PARTITION_INFO_BYTES + TRIM_INFO_BYTES
        )
    finally:
        cf.close()
    with ControlFile.open_or_create(d, KEY, 3) as cf2:
        assert cf2.partition_info(1).assigned
    assert not os.path.exists(os.path.join(d, CONTROL_FILE_NAME + ".tmp"))


def test_crash_during_creation_leaves_no_control_file() -> None:
    for ops in range(4):
        fs = CrashFS(ops)
        fs.arm(ops)
        try:
            _open(fs).close()
        except SimulatedCrash:
            fs.crash()
            assert not fs.exists("/store/" + CONTROL_FILE_NAME)
        with _open(fs) as cf:
            assert cf.partition_info(0) == PartitionInfo()


def test_trim_struct_golden_bytes() -> None:
    assert encode_trim_struct(5, 1).hex() == "000000000000000500000001c4327989"
    assert fresh_trim_info_bytes() == encode_trim_struct(0, -1) + encode_trim_struct(0, 0)
    assert len(fresh_trim_info_bytes()) == TRIM_INFO_BYTES


def test_new_file_is_format_1_with_trim_points_0() -> None:
    fs = CrashFS()
    with _open(fs, n=2) as cf:
        assert cf.header.version == 1
        assert [cf.trim_point(p) for p in range(2)] == [0, 0]
    raw = fs.open("/store/" + CONTROL_FILE_NAME, read_only=True).pread(1000, 0)
    assert len(raw) == HEADER_BYTES + 2 * (PARTITION_INFO_BYTES + TRIM_INFO_BYTES)
    assert raw[:4] == b"\x00\x00\x00\x01"
    assert raw[HEADER_BYTES + 2 * PARTITION_INFO_BYTES :] == fresh_trim_info_bytes() * 2


def test_trim_point_only_moves_up_and_survives_reopen() -> None:
    fs = CrashFS()
    with _open(fs) as cf:
        cf.update(1, session_id=3)
        assert cf.set_trim_point(1, 100) == 100
        assert cf.set_trim_point(1, 50) == 100  # lower: a no-op
        assert cf.set_trim_point(1, 200) == 200
        assert cf.partition_info(1).session_id == 3  # the session fields are untouched
    with _open(fs) as cf2:
        assert [cf2.trim_point(p) for p in range(4)] == [0, 200, 0, 0]
    _, infos, trims = read_control_file_with_trims("/store/" + CONTROL_FILE_NAME, fs)
    assert trims == [0, 200, 0, 0]
    assert infos[1].session_id == 3


@pytest.mark.parametrize("mode", ["garble", "torn", "apply"])
def test_torn_trim_update_rolls_back_at_most_one(mode: str) -> None:
    fs = CrashFS(3)
    cf = _open(fs)
    cf.set_trim_point(2, 10)
    fs.arm(1)
    with pytest.raises(SimulatedCrash):
        cf.set_trim_point(2, 20)
    fs.crash(mode)  # type: ignore[arg-type]
    with _open(fs) as cf2:
        assert cf2.trim_point(2) in (10, 20)
        if mode == "apply":
            assert cf2.trim_point(2) == 20


def test_reset_clears_the_trim_point() -> None:
    fs = CrashFS()
    with _open(fs) as cf:
        cf.set_trim_point(0, 7)
        cf.reset(0)
        assert cf.trim_point(0) == 0
    with _open(fs) as cf2:
        assert cf2.trim_point(0) == 0


def _write_format_0(fs: CrashFS, n: int) -> bytes:
    body = b"".join(fresh_partition_info_bytes(p) for p in range(n))
    raw = ControlHeader(0, CLOCK_MS, KEY, n).encode() + body
    fs.makedirs("/store")
    f = fs.open("/store/" + CONTROL_FILE_NAME, create=True)
    f.pwrite(raw, 0)
    f.fsync()
    f.close()
    fs.fsync_dir("/store")
    fs.fsync_dir("/")
    return raw


def test_format_0_file_is_migrated_keeping_its_entries() -> None:
    fs = CrashFS()
    _write_format_0(fs, 3)
    header, _ = read_control_file("/store/" + CONTROL_FILE_NAME, fs)  # tools read format 0 as it is
    assert header.version == 0
    with _open(fs, n=3) as cf:
        assert cf.header.version == 1
        assert cf.partition_info(1) == PartitionInfo()
        cf.update(1, session_id=9)
        cf.set_trim_point(1, 42)
    fs.crash()
    with _open(fs, n=3) as cf2:
        assert (cf2.partition_info(1).session_id, cf2.trim_point(1)) == (9, 42)


@pytest.mark.parametrize("ops", range(6))
def test_crash_during_migration_leaves_old_or_new_file(ops: int) -> None:
    fs = CrashFS(ops)
    _write_format_0(fs, 2)
    fs.arm(ops)
    try:
        _open(fs, n=2).close()
    except SimulatedCrash:
        fs.crash()
    header, _ = read_control_file("/store/" + CONTROL_FILE_NAME, fs)
    assert header.version in (0, 1)
    with _open(fs, n=2) as cf:
        assert cf.header.version == 1
        assert cf.partition_info(0) == PartitionInfo()
