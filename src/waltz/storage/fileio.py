"""A tiny file layer for the on-disk code, and a crash-simulating fake of it for tests.

The storage code (control file, segments, partitions) does all its I/O through :class:`FileSystem` and
:class:`File`, never through ``open()`` or ``os`` directly, so that tests can swap in :class:`CrashFS`.

:class:`OsFileSystem` is the real thing: ``os.open`` with ``O_CLOEXEC``, positional ``os.pread`` /
``os.pwrite`` (looping over short writes), ``os.fsync`` / ``os.fdatasync``, ``fcntl.flock`` for exclusive
locks and a directory fsync after creating, renaming or removing files. ``OSError`` becomes
:class:`~waltz.errors.StorageError` naming the file.

:class:`CrashFS` is an in-memory file system modelled on SQLite's ``test6.c``. For every file it keeps the
*durable* bytes (what an fsync made stable) and the list of writes and truncations issued since the last
fsync. Reads see every issued operation, as a process does. :meth:`CrashFS.crash` simulates a power loss:
starting from the durable bytes, each unsynced operation is, by a seeded :class:`random.Random`, applied,
dropped, garbled (the same length of random bytes) or torn (a prefix applied, the rest dropped or garbled).
Durable state therefore is exactly what survives a crash. :meth:`CrashFS.arm` makes the N-th mutating
operation (write, truncate or fsync) raise :class:`SimulatedCrash` before it takes effect (a write is left
pending, so the crash may still apply, tear or garble it), which lets a test crash at every point of a
workload. Creating, renaming and removing files is durable at once in the fake (the real layer fsyncs the
directory to match).
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, Protocol

from waltz.errors import ClosedResourceError, StorageError

Buffer = bytes | bytearray | memoryview

CrashMode = Literal["apply", "drop", "garble", "torn"]
CRASH_MODES: tuple[CrashMode, ...] = ("apply", "drop", "garble", "torn")


class File(Protocol):
    """An open file: positional reads and writes, no shared cursor (safe to interleave)."""

    @property
    def path(self) -> str: ...

    def pread(self, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset``; fewer only at the end of the file."""
        ...

    def pwrite(self, data: Buffer, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (extending the file if needed)."""
        ...

    def append(self, data: Buffer) -> int:
        """Write ``data`` at the end of the file; return the offset it was written at."""
        ...

    def truncate(self, size: int) -> None: ...

    def fsync(self, *, data_only: bool = False) -> None:
        """Make every write issued so far durable (``data_only`` allows ``fdatasync``)."""
        ...

    def size(self) -> int: ...

    def lock_exclusive(self) -> None:
        """Take an exclusive, non-blocking lock on the file; StorageError if someone else holds it."""
        ...

    def duplicate(self) -> File:
        """A second handle on the same open file (``dup``), closed on its own: another thread may fsync
        through it while this one is closed meanwhile, without ever touching a reused descriptor."""
        ...

    def close(self) -> None: ...


class FileSystem(Protocol):
    """The directory operations the storage code needs."""

    def open(self, path: str, *, create: bool = False, read_only: bool = False) -> File:
        """Open ``path``; ``create`` makes it if missing (never truncates an existing file)."""
        ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]: ...

    def makedirs(self, path: str) -> None: ...

    def remove(self, path: str) -> None:
        """Remove a file; a missing file is not an error."""
        ...

    def rmdir(self, path: str) -> None:
        """Remove an empty directory; a missing one is not an error."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Atomically replace ``dst`` by ``src`` and make the change durable."""
        ...

    def fsync_dir(self, path: str) -> None: ...


_HAS_FDATASYNC = hasattr(os, "fdatasync")


def _storage_error(path: str, what: str, e: OSError) -> StorageError:
    return StorageError(f"{path}: cannot {what}: {e.strerror or e}")


class OsFile:
    """A real file descriptor."""

    __slots__ = ("_fd", "_path", "_size")

    def __init__(self, path: str, fd: int) -> None:
        self._path = path
        self._fd = fd
        # Cached so that appends need no fstat; every write path below keeps it exact.
        self._size = os.fstat(fd).st_size

    @property
    def path(self) -> str:
        return self._path

    def _check(self) -> int:
        if self._fd < 0:
            raise ClosedResourceError(f"{self._path}: file is closed")
        return self._fd

    def pread(self, size: int, offset: int) -> bytes:
        fd = self._check()
        try:
            return os.pread(fd, size, offset)
        except OSError as e:
            raise _storage_error(self._path, "read", e) from None

    def pwrite(self, data: Buffer, offset: int) -> None:
        fd = self._check()
        view = memoryview(data)
        total = len(view)
        done = 0
        try:
            while done < total:
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise _storage_error(self._path, "write", e) from None
        finally:
            view.release()
        self._size = max(self._size, offset + total)

    def append(self, data: Buffer) -> int:
        offset = self._size
        self.pwrite(data, offset)
        return offset

    def truncate(self, size: int) -> None:
        fd = self._check()
        try:
            os.ftruncate(fd, size)
        except OSError as e:
            raise _storage_error(self._path, "truncate", e) from None
        self._size = size

    def fsync(self, *, data_only: bool = False) -> None:
        fd = self._check()
        if FAULTS.fsync_failures and data_only:
            FAULTS.fsync_failures -= 1
            raise _storage_error(self._path, "fsync", OSError(errno.EIO, "injected I/O error"))
        try:
            if data_only and _HAS_FDATASYNC:
                os.fdatasync(fd)
            else:
                os.fsync(fd)
        except OSError as e:
            raise _storage_error(self._path, "fsync", e) from None

    def size(self) -> int:
        self._check()
        return self._size

    def lock_exclusive(self) -> None:
        fd = self._check()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StorageError(
                    f"{self._path} is locked by another process: two storage nodes cannot share a directory"
                ) from None
            raise _storage_error(self._path, "lock", e) from None

    def duplicate(self) -> File:
        fd = self._check()
        try:
            return OsFile(self._path, os.dup(fd))  # os.dup's descriptor is not inherited (close-on-exec)
        except OSError as e:
            raise _storage_error(self._path, "duplicate the descriptor of", e) from None

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class FaultSwitch:
    """Test-only fault injection into the real file layer, for tests that run real storage processes (the
    node arms it on SIGUSR1 when started with ``WALTZ_TEST_FAULTS=1``). Unarmed it costs one attribute read
    per fsync."""

    def __init__(self) -> None:
        self.fsync_failures = 0
        """How many of the next data-file fsyncs (``data_only=True``) fail with EIO."""

    def fail_next_fsync(self) -> None:
        self.fsync_failures += 1


FAULTS = FaultSwitch()


class OsFileSystem:
    """The real file system."""

    def open(self, path: str, *, create: bool = False, read_only: bool = False) -> File:
        flags = os.O_CLOEXEC | (os.O_RDONLY if read_only else os.O_RDWR)
        if create:
            flags |= os.O_CREAT
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise _storage_error(path, "open", e) from None
        return OsFile(path, fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError as e:
            raise _storage_error(path, "list directory", e) from None

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise _storage_error(path, "create directory", e) from None

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise _storage_error(path, "remove", e) from None

    def rmdir(self, path: str) -> None:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise _storage_error(path, "remove directory", e) from None

    def rename(self, src: str, dst: str) -> None:
        try:
            os.replace(src, dst)
        except OSError as e:
            raise _storage_error(src, f"rename to {dst}", e) from None
        self.fsync_dir(os.path.dirname(dst) or ".")

    def fsync_dir(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise _storage_error(path, "open directory", e) from None
        try:
            os.fsync(fd)
        except OSError as e:
            raise _storage_error(path, "fsync directory", e) from None
        finally:
            os.close(fd)


OS_FS = OsFileSystem()
"""The process-wide real file system (stateless)."""


# --------------------------------------------------------------------------------------------- the fake


class SimulatedCrash(Exception):
    """Raised by an armed :class:`CrashFS` at the chosen operation; the test then calls ``crash()``."""


@dataclass
class _Inode:
    current: bytearray = field(default_factory=bytearray)
    durable: bytearray = field(default_factory=bytearray)
    # Unsynced operations in issue order: ("w", offset, bytes) or ("t", size, b"").
    pending: list[tuple[str, int, bytes]] = field(default_factory=list)
    locked_by: CrashFile | None = None


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


class CrashFS:
    """An in-memory :class:`FileSystem` whose ``crash()`` applies, drops, tears or garbles unsynced writes."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.epoch = 0
        self.fsync_count = 0
        self.ops = 0
        self._files: dict[str, _Inode] = {}
        self._dirs: set[str] = {"/"}
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

    def crash(self, mode: CrashMode | None = None) -> None:
        """Lose power: every file keeps its durable bytes plus a random fate for each unsynced operation.

        ``mode`` forces one fate for every pending operation; by default each draws its own. Open handles
        become unusable and locks are released, as when the process dies.
        """
        rng = self.rng
        for inode in self._files.values():
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
        self.epoch += 1
        self._crash_at = None

    def corrupt(self, path: str, offset: int, data: bytes) -> None:
        """Overwrite bytes durably, as bit rot would (for corruption tests)."""
        inode = self._inode(path)
        _apply_write(inode.current, offset, data)
        _apply_write(inode.durable, offset, data)

    @contextmanager
    def armed(self, ops_until_crash: int) -> Iterator[None]:
        self.arm(ops_until_crash)
        try:
            yield
        finally:
            self.arm(None)

    # -- FileSystem

    def _inode(self, path: str) -> _Inode:
        inode = self._files.get(os.path.normpath(path))
        if inode is None:
            raise StorageError(f"{path}: cannot open: No such file or directory")
        return inode

    def open(self, path: str, *, create: bool = False, read_only: bool = False) -> File:
        key = os.path.normpath(path)
        inode = self._files.get(key)
        if inode is None:
            if not create:
                raise StorageError(f"{path}: cannot open: No such file or directory")
            if os.path.dirname(key) not in self._dirs:
                raise StorageError(f"{path}: cannot open: No such file or directory")
            inode = self._files[key] = _Inode()
        return CrashFile(self, path, inode, read_only)

    def exists(self, path: str) -> bool:
        key = os.path.normpath(path)
        return key in self._files or key in self._dirs

    def listdir(self, path: str) -> list[str]:
        key = os.path.normpath(path)
        if key not in self._dirs:
            raise StorageError(f"{path}: cannot list directory: No such file or directory")
        names = {os.path.basename(p) for p in (*self._files, *self._dirs) if os.path.dirname(p) == key}
        names.discard("")
        return sorted(names)

    def makedirs(self, path: str) -> None:
        key = os.path.normpath(path)
        while key not in self._dirs:
            self._dirs.add(key)
            key = os.path.dirname(key)

    def remove(self, path: str) -> None:
        self._files.pop(os.path.normpath(path), None)

    def rmdir(self, path: str) -> None:
        key = os.path.normpath(path)
        if self.listdir(key) if key in self._dirs else []:
            raise StorageError(f"{path}: cannot remove directory: not empty")
        self._dirs.discard(key)

    def rename(self, src: str, dst: str) -> None:
        self._files[os.path.normpath(dst)] = self._inode(src)
        del self._files[os.path.normpath(src)]

    def fsync_dir(self, path: str) -> None:
        return None
