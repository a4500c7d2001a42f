"""``syncfs`` in the file layer: when the real one is trusted (:func:`waltz.storage.fileio.syncfs_support`),
and the doubles' (CrashFS: data acknowledged after a ``syncfs`` survives a power cut; FaultyFileSystem: a
``syncfs`` fails while a file's fsync is armed to, and each file's own fsync then reports its own error)."""

from __future__ import annotations

import platform
import sys
import uuid
from pathlib import Path

import pytest

from waltz.errors import StorageError
from waltz.protocol.records import Record, ReqId
from waltz.storage import fileio
from waltz.storage.fileio import kernel_version, syncfs_support
from waltz.storage.partition import PartitionLog
from waltz.testing.crashfs import CrashFS
from waltz.testing.faultfs import FaultyFileSystem

KEY = uuid.UUID("0e0e0e0e-1111-2222-3333-444455556666")
ROOT = "/store"


def test_kernel_version_reads_major_and_minor() -> None:
    assert kernel_version("6.18.44-fc-v595") == (6, 18)
    assert kernel_version("5.8.0-63-generic") == (5, 8)
    assert kernel_version("5.7") == (5, 7)
    assert kernel_version("4.19-rc1") == (4, 19)
    assert kernel_version("Darwin") == (0, 0)
    assert kernel_version("5.8") >= fileio.MIN_SYNCFS_KERNEL > kernel_version("5.7.19")


def test_syncfs_is_refused_off_linux_and_before_5_8(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(platform, "release", lambda: "5.4.0-42-generic")
    why, syncfs, _ = syncfs_support(str(tmp_path))
    assert syncfs is None
    assert why == "fdatasync per file: Linux 5.4.0-42-generic < 5.8 does not report syncfs(2) errors"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert syncfs_support(str(tmp_path))[0] == "fdatasync per file: syncfs(2) is Linux-only (darwin)"
    handle, why = fileio.OS_FS.open_fs_sync(str(tmp_path))
    assert handle is None
    assert "Linux-only" in why


def _log(fs: CrashFS, pid: int) -> PartitionLog:
    return PartitionLog.open(
        ROOT, KEY, pid, fs=fs, segment_size_threshold_bytes=1_000_000, segment_cache_capacity=2
    )


def _records(pid: int, first: int, n: int) -> list[Record]:
    return [Record.build(i, ReqId.of(7, 1, pid, i), 0, bytes([pid, i]) * 50) for i in range(first, first + n)]


@pytest.mark.parametrize("seed", range(5))
def test_records_flushed_by_one_syncfs_survive_a_power_cut_in_every_partition(seed: int) -> None:
    fs = CrashFS(seed)
    logs = [_log(fs, pid) for pid in range(4)]
    for pid, plog in enumerate(logs):
        plog.append(_records(pid, 0, 3))
        plog.flush()
        plog.append(_records(pid, 3, 5))  # the group a syncfs makes durable
    fsyncs = fs.fsync_count
    synced = [plog.flush_begin() for plog in logs]
    handle, why = fs.open_fs_sync(ROOT)
    assert handle is not None, why
    handle.syncfs()
    for done in synced:
        done()
    assert fs.fsync_count == fsyncs  # no file's own fsync
    for plog in logs:
        plog.flush()  # nothing left dirty: no fsync
    assert fs.fsync_count == fsyncs
    fs.crash()  # each write since the syncfs gets a random fate; none was
    for pid in range(4):
        plog = _log(fs, pid)
        assert plog.max_transaction_id == 7
        assert [r.data for r in plog.read_records(0, 8)] == [r.data for r in _records(pid, 0, 8)]


def test_without_the_syncfs_the_same_records_are_lost() -> None:
    fs = CrashFS()
    plog = _log(fs, 0)
    plog.append(_records(0, 0, 3))
    plog.flush()
    plog.append(_records(0, 3, 5))
    plog.flush_begin()  # begun, never synced
    fs.crash("drop")
    assert _log(fs, 0).max_transaction_id == 2


def test_a_faulty_syncfs_fails_while_a_file_fsync_is_armed_and_the_file_still_reports_its_own() -> None:
    fs = FaultyFileSystem(CrashFS())
    fs.makedirs("/d")
    files = [fs.open(f"/d/{name}", create=True) for name in ("a", "b")]
    handle, _ = fs.open_fs_sync("/d")
    assert handle is not None
    handle.syncfs()
    fs.fail_next_fsyncs(1, path_part="/d/b")
    with pytest.raises(StorageError, match=r"cannot syncfs.*injected"):
        handle.syncfs()
    files[0].fsync(data_only=True)  # the armed failure is still there for its own file
    with pytest.raises(StorageError, match="/d/b: cannot fsync"):
        files[1].fsync(data_only=True)
    handle.syncfs()
    fs.fail_next_syncfs(1)
    with pytest.raises(StorageError, match="cannot syncfs"):
        handle.syncfs()
    handle.syncfs()
    assert (fs.syncfs_calls, fs.failed_syncfs, fs.failed_fsyncs) == (5, 2, 1)
