"""bench/faults/powerfs: what survives a power cut, on a real FUSE mount (needs /dev/fuse and libfuse 3)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench.faults.powerfs import PowerMount, import_tree, mounted

from waltz.storage.fileio import OS_FS

pytestmark = pytest.mark.fault


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[PowerMount]:
    mount = PowerMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "powerfs.log")
    mount.start()
    try:
        yield mount
    finally:
        mount.stop()
    assert not mounted(tmp_path / "mnt")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes, *, sync: bool) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def test_a_write_not_fsynced_is_dropped_and_the_file_comes_back_empty(fs: PowerMount) -> None:
    m = fs.mountpoint
    _write(m / "f", b"volatile", sync=False)
    _fsync(m)  # the entry is durable, the data is not
    assert (m / "f").read_bytes() == b"volatile"
    fs.cut()
    assert (m / "f").read_bytes() == b""


def test_fsynced_data_is_kept_and_what_follows_the_fsync_is_dropped(fs: PowerMount) -> None:
    m = fs.mountpoint
    data = os.urandom(3 * 4096 + 100)
    _write(m / "f", data, sync=True)
    _fsync(m)
    with (m / "f").open("r+b") as f:
        f.seek(5000)
        f.write(b"x" * 10_000)  # overwrites part of the durable data and extends the file
    fs.cut()
    assert (m / "f").read_bytes() == data


def test_a_truncation_is_durable_only_at_fsync(fs: PowerMount) -> None:
    m = fs.mountpoint
    data = os.urandom(10_000)
    _write(m / "f", data, sync=True)
    _fsync(m)
    os.truncate(m / "f", 100)
    with (m / "f").open("r+b") as f:
        f.seek(6000)
        f.write(b"y")  # the hole between 100 and 6000 reads as zeros, not as the old data
    assert (m / "f").read_bytes() == data[:100] + bytes(5900) + b"y"
    fs.cut()
    assert (m / "f").read_bytes() == data
    os.truncate(m / "f", 100)
    _fsync(m / "f")
    fs.cut()
    assert (m / "f").read_bytes() == data[:100]


def test_a_mkdir_whose_parent_was_not_fsynced_is_dropped(fs: PowerMount) -> None:
    m = fs.mountpoint
    (m / "kept").mkdir()
    _fsync(m)
    (m / "kept" / "lost").mkdir()
    _write(m / "kept" / "lost" / "f", b"data", sync=True)
    _fsync(m / "kept" / "lost")  # the subdirectory's own entries, but not its entry in kept/
    (m / "also-lost").mkdir()
    fs.cut()
    assert sorted(p.name for p in m.iterdir()) == ["kept"]
    assert list((m / "kept").iterdir()) == []


def test_a_rename_is_durable_only_after_its_directory_is_fsynced(fs: PowerMount) -> None:
    m = fs.mountpoint
    _write(m / "a.tmp", b"new contents", sync=True)
    _fsync(m)
    (m / "a.tmp").rename(m / "a")
    fs.cut()
    assert sorted(p.name for p in m.iterdir()) == ["a.tmp"]
    (m / "a.tmp").rename(m / "a")
    _fsync(m)
    fs.cut()
    assert sorted(p.name for p in m.iterdir()) == ["a"]
    assert (m / "a").read_bytes() == b"new contents"


def test_an_unlink_and_an_rmdir_are_durable_only_after_their_directory_is_fsynced(fs: PowerMount) -> None:
    m = fs.mountpoint
    _write(m / "f", b"data", sync=True)
    (m / "d").mkdir()
    _fsync(m)
    (m / "f").unlink()
    (m / "d").rmdir()
    fs.cut()
    assert sorted(p.name for p in m.iterdir()) == ["d", "f"]
    assert (m / "f").read_bytes() == b"data"
    (m / "f").unlink()
    (m / "d").rmdir()
    _fsync(m)
    fs.cut()
    assert list(m.iterdir()) == []


def test_o_dsync_writes_are_durable_at_once(fs: PowerMount) -> None:
    m = fs.mountpoint
    fd = os.open(m / "f", os.O_WRONLY | os.O_CREAT | os.O_DSYNC, 0o644)
    try:
        os.write(fd, b"synchronous")
    finally:
        os.close(fd)
    _fsync(m)
    fs.cut()
    assert (m / "f").read_bytes() == b"synchronous"


def test_with_fsync_a_no_op_nothing_survives_a_cut(tmp_path: Path) -> None:
    mount = PowerMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "log", fsync_enabled=False)
    mount.start()
    try:
        _write(mount.mountpoint / "f", b"data", sync=True)
        _fsync(mount.mountpoint)
        mount.cut()
        assert list(mount.mountpoint.iterdir()) == []
    finally:
        mount.stop()


def test_an_imported_tree_is_durable_and_unreachable_inodes_are_collected(tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "d").mkdir(parents=True)
    (source / "d" / "f").write_bytes(b"imported")
    import_tree(source, tmp_path / "backing")
    mount = PowerMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "log")
    mount.start()
    try:
        m = mount.mountpoint
        assert (m / "d" / "f").read_bytes() == b"imported"
        _write(m / "orphan", b"synced, but its entry never was", sync=True)
        assert len(list((tmp_path / "backing" / "data").iterdir())) == 2
        mount.cut()
        assert sorted(p.name for p in m.iterdir()) == ["d"]
        assert len(list((tmp_path / "backing" / "data").iterdir())) == 1
    finally:
        mount.stop()


def test_in_journal_mode_a_file_fsync_also_commits_every_directory_entry(tmp_path: Path) -> None:
    mount = PowerMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "log", journal=True)
    mount.start()
    try:
        m = mount.mountpoint
        (m / "version-2").mkdir()
        _write(m / "version-2" / "log.1", b"entry", sync=True)  # no directory is fsynced
        (m / "version-2" / "log.2").touch()  # created after the last fsync: lost
        mount.cut()
        assert [p.name for p in (m / "version-2").iterdir()] == ["log.1"]
        assert (m / "version-2" / "log.1").read_bytes() == b"entry"
    finally:
        mount.stop()


def test_syncfs_does_not_reach_a_fuse_daemon_so_the_storage_node_does_not_trust_it(fs: PowerMount) -> None:
    """Linux sends FUSE_SYNCFS to virtiofs only: on powerfs a syncfs returns 0 and makes nothing durable. The
    file layer must refuse it there (the node then fdatasyncs each file), and does."""
    m = fs.mountpoint
    handle, why = OS_FS.open_fs_sync(str(m))
    assert handle is None
    assert "not f_type 0x65735546" in why  # FUSE_SUPER_MAGIC
    _write(m / "f", b"acknowledged?", sync=False)
    _fsync(m)
    fd = os.open(m, os.O_RDONLY)
    try:
        assert ctypes.CDLL(None, use_errno=True).syncfs(fd) == 0
    finally:
        os.close(fd)
    fs.cut()
    assert (m / "f").read_bytes() == b""  # what a node trusting that syncfs would have acknowledged, lost
