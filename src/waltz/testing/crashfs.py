"""A crash-simulating, in-memory :class:`~waltz.storage.fileio.FileSystem` for the storage code's tests.

Modelled on SQLite's ``test6.c`` and LazyFS, and exactly as strict as POSIX, never kinder:

* **File data** is durable only once that file is fsynced. For every file :class:`CrashFS` keeps the
  *durable* bytes (what an fsync made stable) and the writes and truncations issued since.
* **A directory entry** (a create, a mkdir, a rename, an unlink, an rmdir) is durable only once its parent
  directory is fsynced (:meth:`CrashFS.fsync_dir`). Every directory keeps its durable entries and the entry
  operations issued since its last fsync, in order.

Reads, listings and ``exists`` see every issued operation, as a process does. :meth:`CrashFS.crash` simulates
a power loss. Each directory keeps its durable entries plus a random *prefix* of its pending entry operations
(so it ends in a state it really had: a journaling file system commits metadata in order); the directory
tree is then rebuilt from the root, so a directory whose own entry was dropped takes everything inside it
along, fsynced or not. Each surviving file keeps its durable bytes plus, by a seeded
:class:`random.Random`, a fate for each unsynced write or truncation: applied, dropped, garbled (the same
length of random bytes) or torn (a prefix applied, the rest dropped or garbled). A file whose name did not
survive is gone whatever was fsynced into it.

:meth:`CrashFS.arm` makes the N-th mutating operation (a write, truncate, fsync, directory fsync, create,
mkdir, rename, remove or rmdir) raise :class:`SimulatedCrash` before it takes effect (a write is left
pending, so the crash may still apply, tear or garble it), which lets a test crash at every point of a
workload. :meth:`CrashFS.crash` with ``mode="apply"`` keeps everything issued (a process kill, not a power
loss); ``mode="drop"`` keeps only what was made durable.

:meth:`CrashFS.open_fs_sync` gives a ``syncfs`` handle: it makes the data of every file durable (as an
fsync of each would), and no directory entry (stricter than ext4, whose journal commit would).

``rename`` stays within one directory (the storage code renames nothing across directories) and, like
:class:`~waltz.storage.fileio.OsFileSystem`, fsyncs that directory before returning.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, Union

from waltz.errors import ClosedResourceError, StorageError
from waltz.storage.fileio import Buffer, File, FsSync

__all__ = ["CRASH_MODES", "CrashFS", "CrashFile", "CrashFsSync", "CrashMode", "SimulatedCrash"]

CrashMode = Literal["apply", "drop", "garble", "torn"]
CRASH_MODES: tuple[CrashMode, ...] = ("apply", "drop", "garble", "torn")


class SimulatedCrash(Exception):
    """Raised by an armed :class:`CrashFS` at the chosen operation; the test then calls ``crash()``."""


@dataclass(eq=False)
class _Inode:
    current: bytearray = field(default_factory=bytearray)
    durable: bytearray = field(default_factory=bytearray)
    # Unsynced operations in issue order: ("w", offset, bytes) or ("t", size, b"").
    pending: list[tuple[str, int, bytes]] = field(default_factory=list)
    locked_by: CrashFile | None = None


_Entry = Union[_Inode, "_Dir"]


@dataclass(eq=False)
class _Dir:
    current: dict[str, _Entry] = field(default_factory=dict)
    durable: dict[str, _Entry] = field(default_factory=dict)
    # Unsynced entry operations in issue order: ("set", name, entry), ("del", name, None) or
    # ("mv", source name, destination name).
    pending: list[tuple[str, str, _Entry | str | None]] = field(default_factory=list)


class CrashFile:
    """A handle on a :class:`CrashFS` inode; invalid after the file system crashes."""

    def __init__(self, fs: CrashFS, path: str, inode: _Inode, read_only: bool) -> None:
        self._fs = fs
        self._path = path
        self._inode = inode
        self._read_only = read_only
        self._epoch = fs.epoch
        self._closed = False

    @property
    def path(self) -> str:
        return self._path

    def _check(self, write: bool = False) -> _Inode:
        if self._closed:
            raise ClosedResourceError(f"{self._path}: file is closed")
        if self._epoch != self._fs.epoch:
            raise ClosedResourceError(f"{self._path}: the process crashed")
        if write and self._read_only:
            raise StorageError(f"{self._path}: cannot write: opened read-only")
        return self._inode

    def pread(self, size: int, offset: int) -> bytes:
        inode = self._check()
        if size < 0 or offset < 0:
            raise StorageError(f"{self._path}: bad read of {size} bytes at {offset}")
        return bytes(inode.current[offset : offset + size])

    def pwrite(self, data: Buffer, offset: int) -> None:
        inode = self._check(write=True)
        raw = bytes(data)
        inode.pending.append(("w", offset, raw))
        self._fs._tick(f"write {len(raw)} bytes at {offset} of {self._path}")
        _apply_write(inode.current, offset, raw)

    def append(self, data: Buffer) -> int:
        offset = len(self._check().current)
        self.pwrite(data, offset)
        return offset

    def truncate(self, size: int) -> None:
        inode = self._check(write=True)
        self._fs._tick(f"truncate {self._path} to {size}")
        inode.pending.append(("t", size, b""))
        _apply_truncate(inode.current, size)

    def fsync(self, *, data_only: bool = False) -> None:
        inode = self._check()
        self._fs._tick(f"fsync {self._path}")
        self._fs.fsync_count += 1
        inode.durable = bytearray(inode.current)
        inode.pending.clear()

    def size(self) -> int:
        return len(self._check().current)

    def lock_exclusive(self) -> None:
        inode = self._check()
        holder = inode.locked_by
        if (
            holder is not None
            and holder is not self
            and not holder._closed
            and holder._epoch == self._fs.epoch
        ):
            raise StorageError(
                f"{self._path} is locked by another process: two storage nodes cannot share a directory"
            )
        inode.locked_by = self

    def duplicate(self) -> File:
        self._check()
        return CrashFile(self._fs, self._path, self._inode, self._read_only)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._inode.locked_by is self:
                self._inode.locked_by = None


def _apply_write(buf: bytearray, offset: int, data: bytes) -> None:
    end = offset + len(data)
    if offset > len(buf):
        buf.extend(bytes(offset - len(buf)))
    buf[offset:end] = data


def _apply_truncate(buf: bytearray, size: int) -> None:
    if size < len(buf):
        del buf[size:]
    else:
        buf.extend(bytes(size - len(buf)))


def _split(path: str) -> list[str]:
    key = os.path.normpath(path)
    if not key.startswith("/"):
        raise StorageError(f"{path}: CrashFS paths must be absolute")
    return [part for part in key.split("/") if part]


class CrashFS:
    """An in-memory :class:`~waltz.storage.fileio.FileSystem` whose ``crash()`` keeps only what POSIX
    promises (see the module docstring)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.epoch = 0
        self.fsync_count = 0
        self.dir_fsync_count = 0
        self.syncfs_count = 0
        self.ops = 0
        self._root = _Dir()
        self._crash_at: int | None = None

    # -- fault injection

    def arm(self, ops_until_crash: int | None) -> None:
        """Raise :class:`SimulatedCrash` at the ``ops_until_crash``-th next mutating operation (0: next)."""
        self._crash_at = None if ops_until_crash is None else self.ops + ops_until_crash

    def _tick(self, what: str) -> None:
        at = self.ops
        self.ops += 1
        if self._crash_at is not None and at >= self._crash_at:
            self._crash_at = None
            raise SimulatedCrash(f"simulated crash at op {at}: {what}")

    @contextmanager
    def armed(self, ops_until_crash: int) -> Iterator[None]:
        self.arm(ops_until_crash)
        try:
            yield
        finally:
            self.arm(None)

    def crash(self, mode: CrashMode | None = None) -> None:
        """Lose power: keep what was durable plus a random fate for each operation that was not.

        ``mode`` forces one fate for every pending operation (``apply``: keep every issued operation, as a
        process kill does; ``drop``: keep only the durable state); by default each draws its own. Open handles
        become unusable and locks are released, as when the process dies.
        """
        seen: set[int] = set()
        self._settle_dir(self._root, mode, seen)
        self.epoch += 1
        self._crash_at = None

    def _settle_dir(self, d: _Dir, mode: CrashMode | None, seen: set[int]) -> None:
        state = dict(d.durable)
        if mode == "apply":
            keep = len(d.pending)
        elif mode == "drop":
            keep = 0
        else:
            keep = self.rng.randint(0, len(d.pending))
        for op, name, arg in d.pending[:keep]:
            if op == "set":
                assert isinstance(arg, (_Inode, _Dir))
                state[name] = arg
            elif op == "del":
                state.pop(name, None)
            else:  # "mv": name -> arg
                assert isinstance(arg, str)
                moved = state.pop(name, None)
                if moved is not None:
                    state[arg] = moved
        d.current = state
        d.durable = dict(state)
        d.pending.clear()
        for entry in state.values():
            if id(entry) in seen:
                continue
            seen.add(id(entry))
            if isinstance(entry, _Dir):
                self._settle_dir(entry, mode, seen)
            else:
                self._settle_file(entry, mode)

    def _settle_file(self, inode: _Inode, mode: CrashMode | None) -> None:
        rng = self.rng
        state = bytearray(inode.durable)
        for kind, arg, data in inode.pending:
            fate = mode or rng.choice(CRASH_MODES)
            if kind == "t":
                if fate != "drop":
                    _apply_truncate(state, arg)
                continue
            if fate == "apply":
                _apply_write(state, arg, data)
            elif fate == "garble":
                _apply_write(state, arg, rng.randbytes(len(data)))
            elif fate == "torn" and data:
                cut = rng.randrange(len(data))
                tail = rng.randbytes(len(data) - cut) if rng.random() < 0.5 else b""
                _apply_write(state, arg, data[:cut] + tail)
        inode.current = state
        inode.durable = bytearray(state)
        inode.pending.clear()
        inode.locked_by = None

    def corrupt(self, path: str, offset: int, data: bytes) -> None:
        """Overwrite bytes durably, as bit rot would (for corruption tests)."""
        inode = self._file(path)
        _apply_write(inode.current, offset, data)
        _apply_write(inode.durable, offset, data)

    def pending_entries(self, path: str) -> int:
        """How many entry operations of directory ``path`` are not durable yet (for tests)."""
        return len(self._dir(path).pending)

    # -- lookups

    def _lookup(self, path: str) -> _Entry | None:
        entry: _Entry = self._root
        for part in _split(path):
            if not isinstance(entry, _Dir):
                return None
            nxt = entry.current.get(part)
            if nxt is None:
                return None
            entry = nxt
        return entry

    def _dir(self, path: str, what: str = "list directory") -> _Dir:
        d = self._lookup(path)
        if not isinstance(d, _Dir):
            raise StorageError(f"{path}: cannot {what}: No such directory")
        return d

    def _file(self, path: str) -> _Inode:
        inode = self._lookup(path)
        if not isinstance(inode, _Inode):
            raise StorageError(f"{path}: cannot open: No such file or directory")
        return inode

    def _parent(self, path: str, what: str) -> tuple[_Dir, str]:
        parts = _split(path)
        if not parts:
            raise StorageError(f"{path}: cannot {what}: it is the root")
        return self._dir("/" + "/".join(parts[:-1]), what), parts[-1]

    # -- FileSystem

    def open(self, path: str, *, create: bool = False, read_only: bool = False) -> File:
        entry = self._lookup(path)
        if isinstance(entry, _Dir):
            raise StorageError(f"{path}: cannot open: Is a directory")
        if entry is None:
            if not create:
                raise StorageError(f"{path}: cannot open: No such file or directory")
            parent, name = self._parent(path, "open")
            self._tick(f"create {path}")
            entry = _Inode()
            parent.current[name] = entry
            parent.pending.append(("set", name, entry))
        return CrashFile(self, path, entry, read_only)

    def exists(self, path: str) -> bool:
        return self._lookup(path) is not None

    def listdir(self, path: str) -> list[str]:
        return sorted(self._dir(path).current)

    def makedirs(self, path: str) -> None:
        d = self._root
        walked = ""
        for part in _split(path):
            walked += "/" + part
            nxt = d.current.get(part)
            if nxt is None:
                self._tick(f"mkdir {walked}")
                nxt = _Dir()
                d.current[part] = nxt
                d.pending.append(("set", part, nxt))
            elif not isinstance(nxt, _Dir):
                raise StorageError(f"{walked}: cannot create directory: File exists")
            d = nxt

    def remove(self, path: str) -> None:
        entry = self._lookup(path)
        if entry is None:
            return
        if isinstance(entry, _Dir):
            raise StorageError(f"{path}: cannot remove: Is a directory")
        parent, name = self._parent(path, "remove")
        self._tick(f"remove {path}")
        del parent.current[name]
        parent.pending.append(("del", name, None))

    def rmdir(self, path: str) -> None:
        entry = self._lookup(path)
        if entry is None:
            return
        if not isinstance(entry, _Dir):
            raise StorageError(f"{path}: cannot remove directory: Not a directory")
        if entry.current:
            raise StorageError(f"{path}: cannot remove directory: not empty")
        parent, name = self._parent(path, "remove directory")
        self._tick(f"rmdir {path}")
        del parent.current[name]
        parent.pending.append(("del", name, None))

    def rename(self, src: str, dst: str) -> None:
        src_parent, src_name = self._parent(src, "rename")
        dst_parent, dst_name = self._parent(dst, "rename")
        if src_parent is not dst_parent:
            raise StorageError(f"{src}: cannot rename to {dst}: CrashFS renames only within a directory")
        if not isinstance(src_parent.current.get(src_name), _Inode):
            raise StorageError(f"{src}: cannot rename: No such file")
        self._tick(f"rename {src} to {dst}")
        src_parent.current[dst_name] = src_parent.current.pop(src_name)
        src_parent.pending.append(("mv", src_name, dst_name))
        self.fsync_dir(os.path.dirname(os.path.normpath(dst)) or "/")

    def fsync_dir(self, path: str) -> None:
        d = self._dir(path, "fsync directory")
        self._tick(f"fsync directory {path}")
        self.dir_fsync_count += 1
        d.durable = dict(d.current)
        d.pending.clear()

    def open_fs_sync(self, path: str) -> tuple[FsSync | None, str]:
        self._dir(path, "open directory")
        return CrashFsSync(self, path), "syncfs(2) on CrashFS"

    def _sync_all(self) -> None:
        """Every file's data durable (what a ``syncfs`` does here)."""
        stack: list[_Dir] = [self._root]
        seen: set[int] = set()
        while stack:
            d = stack.pop()
            for entry in d.current.values():
                if id(entry) in seen:
                    continue
                seen.add(id(entry))
                if isinstance(entry, _Dir):
                    stack.append(entry)
                else:
                    entry.durable = bytearray(entry.current)
                    entry.pending.clear()


class CrashFsSync:
    """A ``syncfs`` handle on a :class:`CrashFS`; invalid after the file system crashes."""

    def __init__(self, fs: CrashFS, path: str) -> None:
        self._fs = fs
        self._path = path
        self._epoch = fs.epoch

    @property
    def path(self) -> str:
        return self._path

    def syncfs(self) -> None:
        if self._epoch != self._fs.epoch:
            raise ClosedResourceError(f"{self._path}: the process crashed")
        self._fs._tick(f"syncfs {self._path}")
        self._fs.syncfs_count += 1
        self._fs._sync_all()

    def close(self) -> None:
        pass
