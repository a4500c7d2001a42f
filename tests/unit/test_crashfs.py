"""CrashFS keeps exactly what POSIX promises across a power cut: file data at the file's fsync, a directory
entry (create, mkdir, rename, unlink, rmdir) at its parent directory's fsync, and nothing else."""

from __future__ import annotations

import pytest

from waltz.errors import StorageError
from waltz.storage.fileio import make_dirs_durable
from waltz.testing.crashfs import CrashFS, SimulatedCrash


def _write(fs: CrashFS, path: str, data: bytes) -> None:
    f = fs.open(path, create=True)
    f.pwrite(data, 0)
    f.fsync()
    f.close()


def test_a_fsynced_file_in_an_unsynced_directory_entry_is_lost() -> None:
    fs = CrashFS()
    fs.makedirs("/a")
    _write(fs, "/a/f", b"data")
    fs.fsync_dir("/a")  # f's entry is durable in /a, but /a's own entry in / is not
    fs.crash("drop")
    assert not fs.exists("/a")
    assert not fs.exists("/a/f")
    assert fs.listdir("/") == []


def test_make_dirs_durable_keeps_the_new_directories() -> None:
    fs = CrashFS()
    assert make_dirs_durable(fs, "/a/b/c")
    assert not make_dirs_durable(fs, "/a/b/c")
    _write(fs, "/a/b/c/f", b"data")
    fs.fsync_dir("/a/b/c")
    fs.crash("drop")
    f = fs.open("/a/b/c/f")
    assert f.pread(10, 0) == b"data"


def test_an_unsynced_create_is_dropped_and_a_synced_one_kept() -> None:
    fs = CrashFS()
    _write(fs, "/kept", b"1")
    fs.fsync_dir("/")
    _write(fs, "/dropped", b"2")
    fs.crash("drop")
    assert fs.listdir("/") == ["kept"]


def test_an_unsynced_unlink_and_rmdir_come_back() -> None:
    fs = CrashFS()
    make_dirs_durable(fs, "/d")
    _write(fs, "/f", b"x")
    fs.fsync_dir("/")
    fs.remove("/f")
    fs.rmdir("/d")
    assert fs.listdir("/") == []
    fs.crash("drop")
    assert fs.listdir("/") == ["d", "f"]
    fs.remove("/f")
    fs.rmdir("/d")
    fs.fsync_dir("/")
    fs.crash("drop")
    assert fs.listdir("/") == []


def test_rename_is_durable_on_return_and_atomic() -> None:
    fs = CrashFS()
    _write(fs, "/old", b"old")
    fs.fsync_dir("/")
    _write(fs, "/tmp", b"new")
    fs.rename("/tmp", "/old")
    fs.crash("drop")
    assert fs.listdir("/") == ["old"]
    assert fs.open("/old").pread(3, 0) == b"new"
    make_dirs_durable(fs, "/x")
    with pytest.raises(StorageError, match="within a directory"):
        fs.rename("/old", "/x/old")


def test_a_crash_keeps_a_state_the_directory_really_had() -> None:
    """Pending entry operations survive as a prefix, in issue order: never a later one without an earlier."""
    for seed in range(40):
        fs = CrashFS(seed)
        for name in "abcde":
            _write(fs, f"/{name}", name.encode())
        fs.crash()
        names = fs.listdir("/")
        assert names == sorted("abcde")[: len(names)], seed


def test_directory_operations_are_crash_points() -> None:
    fs = CrashFS()
    ops = []
    for what in (
        lambda: fs.makedirs("/d"),
        lambda: fs.open("/d/f", create=True),
        lambda: fs.fsync_dir("/d"),
        lambda: fs.rename("/d/f", "/d/g"),
        lambda: fs.remove("/d/g"),
        lambda: fs.rmdir("/d"),
    ):
        fs.arm(0)
        with pytest.raises(SimulatedCrash):
            what()
        fs.arm(None)
        ops.append(fs.ops)
        what()
    assert ops == sorted(ops)
