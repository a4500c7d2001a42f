"""A tiny file layer for the on-disk code.

The storage code (control file, segments, partitions) does all its I/O through :class:`FileSystem` and
:class:`File`, never through ``open()`` or ``os`` directly, so that tests can swap in the crash-simulating
:class:`waltz.testing.crashfs.CrashFS` or the failing :class:`waltz.testing.faultfs.FaultyFileSystem`.

:class:`OsFileSystem` is the real thing: ``os.open`` with ``O_CLOEXEC``, positional ``os.pread`` /
``os.pwrite`` (looping over short writes), ``os.fsync`` / ``os.fdatasync``, ``fcntl.flock`` for exclusive
locks and a directory fsync after a rename. ``OSError`` becomes
:class:`~waltz.errors.StorageError` naming the file.

Durability follows POSIX and nothing kinder: a file's data is durable once the file is fsynced, a
directory entry (a create, a mkdir, a rename, an unlink, an rmdir) once its parent directory is fsynced.
``rename`` fsyncs the directory itself; everything else is the caller's to fsync (:func:`make_dirs_durable`
for new directories).

:meth:`FileSystem.open_fs_sync` gives a handle whose :meth:`FsSync.syncfs` makes every file of a whole file
system durable at once (``syncfs(2)``, one call for the data files of many partitions), where that is
trustworthy: on Linux from kernel 5.8 (before, ``syncfs`` returned 0 even when writeback failed), with a libc
that has ``syncfs``, and on a file system known to commit it to the disk (ext4, XFS, btrfs; not FUSE, whose
``syncfs`` never reaches the daemon, nor network file systems). Elsewhere it gives no handle and says why;
the caller then fsyncs each file. A failed ``syncfs`` does not consume the files' own error reports: each
file's next ``fsync`` still reports its own writeback error (Linux keeps one error sequence per file and one
per file system), which is how the caller finds which files failed.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import sys
from collections.abc import Callable
from typing import Protocol

from waltz.errors import ClosedResourceError, StorageError

Buffer = bytes | bytearray | memoryview


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

    def makedirs(self, path: str) -> None:
        """Create ``path`` and missing parents (not durable: see :func:`make_dirs_durable`)."""
        ...

    def remove(self, path: str) -> None:
        """Remove a file; a missing file is not an error. Durable at the next fsync of its directory."""
        ...

    def rmdir(self, path: str) -> None:
        """Remove an empty directory; a missing one is not an error."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Atomically replace ``dst`` by ``src`` and make the change durable."""
        ...

    def fsync_dir(self, path: str) -> None: ...

    def open_fs_sync(self, path: str) -> tuple[FsSync | None, str]:
        """A handle on directory ``path`` whose :meth:`FsSync.syncfs` makes every file of its file system
        durable, or None where that cannot be trusted; and a few words saying which and why (for the log)."""
        ...


class FsSync(Protocol):
    """A descriptor on a directory, for ``syncfs(2)`` of the file system that holds it."""

    @property
    def path(self) -> str: ...

    def syncfs(self) -> None:
        """Make every write issued so far to any file of the file system durable (data and sizes); a
        StorageError if the file system reports a writeback error since the last call (or since the open)."""
        ...

    def close(self) -> None: ...


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
        total = len(data)
        try:
            done = os.pwrite(fd, data, offset)
            if done < total:  # a short write (rare): the rest through a view, not a copy per retry
                with memoryview(data) as view:
                    while done < total:
                        done += os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise _storage_error(self._path, "write", e) from None
        if offset + total > self._size:
            self._size = offset + total

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

    def open_fs_sync(self, path: str) -> tuple[FsSync | None, str]:
        why_not, syncfs, fs_name = syncfs_support(path)
        if syncfs is None:
            return None, why_not
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise _storage_error(path, "open directory", e) from None
        return OsFsSync(path, fd, syncfs), f"syncfs(2) on {fs_name}, Linux {platform.release()}"


_FS_TYPES = {0xEF53: "ext4", 0x58465342: "XFS", 0x9123683E: "btrfs"}
"""``statfs`` ``f_type`` of the file systems whose ``syncfs`` writes back every dirty file, commits the
journal (or transaction) and flushes the disk's cache, as an ``fsync`` of each file would (0xEF53 also names
ext2 and ext3, mounted by the ext4 driver nowadays)."""
MIN_SYNCFS_KERNEL = (5, 8)
"""Linux reports writeback errors from ``syncfs`` from 5.8 on (commit 735e4ae5ba28); before, it returned 0."""


def kernel_version(release: str) -> tuple[int, int]:
    """(major, minor) of a ``uname -r`` string such as ``6.18.44-fc``; (0, 0) if it does not start so."""
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1].split("-")[0] if c.isdigit()) or "x")
    except (IndexError, ValueError):
        return (0, 0)


def syncfs_support(path: str) -> tuple[str, Callable[[int], int] | None, str]:
    """Whether ``syncfs`` may replace the fsyncs of the files under ``path``: (why not, or "", libc's
    ``syncfs`` or None, the file system's name)."""
    if not sys.platform.startswith("linux"):
        return f"fdatasync per file: syncfs(2) is Linux-only ({sys.platform})", None, ""
    release = platform.release()
    if kernel_version(release) < MIN_SYNCFS_KERNEL:
        return f"fdatasync per file: Linux {release} < 5.8 does not report syncfs(2) errors", None, ""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syncfs, statfs = libc.syncfs, libc.statfs
    except (OSError, AttributeError):
        return "fdatasync per file: the C library has no syncfs(2)", None, ""
    syncfs.argtypes, syncfs.restype = [ctypes.c_int], ctypes.c_int
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux); f_type first
    if statfs(os.fsencode(path), buf) != 0:
        return f"fdatasync per file: statfs({path}): {os.strerror(ctypes.get_errno())}", None, ""
    f_type = ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF
    name = _FS_TYPES.get(f_type)
    if name is None:
        why = f"fdatasync per file: syncfs(2) is trusted only on ext4, XFS and btrfs, not f_type {f_type:#x}"
        return why, None, ""
    return "", syncfs, name


class OsFsSync:
    """A descriptor on a directory for ``syncfs(2)`` (called through ctypes, which releases the GIL)."""

    __slots__ = ("_fd", "_path", "_syncfs")

    def __init__(self, path: str, fd: int, syncfs: Callable[[int], int]) -> None:
        self._path = path
        self._fd = fd
        self._syncfs = syncfs

    @property
    def path(self) -> str:
        return self._path

    def syncfs(self) -> None:
        if self._fd < 0:
            raise ClosedResourceError(f"{self._path}: file system sync handle is closed")
        if self._syncfs(self._fd) != 0:
            e = ctypes.get_errno()
            raise StorageError(f"{self._path}: cannot syncfs: {os.strerror(e)}")

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


OS_FS = OsFileSystem()
"""The process-wide real file system (stateless)."""


def make_dirs_durable(fs: FileSystem, path: str) -> bool:
    """Create ``path`` and any missing parents, and make each new directory's entry durable (an fsync of its
    parent) before returning. True if anything was created. A directory that already exists is taken as
    durable: a process only ever sees, after a crash, what the crash kept."""
    missing: list[str] = []
    p = os.path.normpath(path)
    while not fs.exists(p):
        missing.append(p)
        parent = os.path.dirname(p) or "."
        if parent == p:
            break
        p = parent
    if not missing:
        return False
    fs.makedirs(path)
    for d in reversed(missing):
        fs.fsync_dir(os.path.dirname(d) or ".")
    return True
