"""A failing :class:`~waltz.storage.fileio.FileSystem` for the storage code's tests, and a storage node
process that runs on it.

:class:`FaultyFileSystem` wraps a real file layer (the OS's by default) and passes everything through,
except that the next N data fsyncs (``fsync(data_only=True)``: a segment's data or index file, as a group
commit makes them durable) fail with EIO after :meth:`FaultyFileSystem.fail_next_fsyncs`, as a dying disk's
would. While data fsyncs are armed to fail, or after :meth:`FaultyFileSystem.fail_next_syncfs`, a
``syncfs`` of the file system (:meth:`~waltz.storage.fileio.FileSystem.open_fs_sync`) fails too, as the
kernel's would report a writeback error of any of its files; the files' own fsyncs then tell which failed.
A test that runs a node in its own process injects it with
:class:`~waltz.storage.node.StorageNode` ``.start(..., fs=FaultyFileSystem())``.

For a node in a subprocess, ``python -m waltz.testing.faultfs --config FILE`` runs one as
``waltz storage run --config FILE`` does (the same ready line on stdout), on a :class:`FaultyFileSystem`;
each SIGUSR1 then makes its next data fsync fail. Production code has no such switch: only this entry point
installs the handler.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from waltz.errors import StorageError
from waltz.storage.fileio import OS_FS, Buffer, File, FileSystem, FsSync

__all__ = ["FaultyFile", "FaultyFileSystem", "FaultyFsSync", "main"]


class FaultyFileSystem:
    """:class:`~waltz.storage.fileio.FileSystem` over ``inner`` whose next data fsyncs can be made to fail."""

    def __init__(self, inner: FileSystem = OS_FS) -> None:
        self.inner = inner
        self.fsync_failures = 0
        """How many of the next data fsyncs (``data_only=True``) fail with EIO."""
        self.failing_path: str | None = None
        """If set, only data fsyncs of files whose path contains it fail (and count down)."""
        self.failed_fsyncs = 0
        """How many failed so far."""
        self.syncfs_failures = 0
        """How many of the next syncfs calls fail with EIO (besides those failing while fsyncs are armed)."""
        self.failed_syncfs = 0
        """How many syncfs calls failed so far."""
        self.syncfs_calls = 0
        """How many syncfs calls were made (failed or not)."""

    def fail_next_fsyncs(self, n: int = 1, *, path_part: str | None = None) -> None:
        """Fail the next ``n`` data fsyncs, of files whose path contains ``path_part`` if given."""
        self.fsync_failures += n
        self.failing_path = path_part

    def fail_next_syncfs(self, n: int = 1) -> None:
        """Fail the next ``n`` syncfs calls (the files' own fsyncs still succeed unless armed)."""
        self.syncfs_failures += n

    def open_fs_sync(self, path: str) -> tuple[FsSync | None, str]:
        inner, why = self.inner.open_fs_sync(path)
        return (FaultyFsSync(self, inner) if inner is not None else None), why

    def open(self, path: str, *, create: bool = False, read_only: bool = False) -> File:
        return FaultyFile(self, self.inner.open(path, create=create, read_only=read_only))

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)

    def remove(self, path: str) -> None:
        self.inner.remove(path)

    def rmdir(self, path: str) -> None:
        self.inner.rmdir(path)

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        self.inner.fsync_dir(path)


class FaultyFile:
    """A file of a :class:`FaultyFileSystem`: its ``fsync(data_only=True)`` fails while the file system has
    failures armed (nothing is synced then, as after a real EIO nothing can be trusted to be)."""

    __slots__ = ("_fs", "_inner")

    def __init__(self, fs: FaultyFileSystem, inner: File) -> None:
        self._fs = fs
        self._inner = inner

    @property
    def path(self) -> str:
        return self._inner.path

    def pread(self, size: int, offset: int) -> bytes:
        return self._inner.pread(size, offset)

    def pwrite(self, data: Buffer, offset: int) -> None:
        self._inner.pwrite(data, offset)

    def append(self, data: Buffer) -> int:
        return self._inner.append(data)

    def truncate(self, size: int) -> None:
        self._inner.truncate(size)

    def fsync(self, *, data_only: bool = False) -> None:
        fs = self._fs
        if data_only and fs.fsync_failures > 0 and (fs.failing_path is None or fs.failing_path in self.path):
            fs.fsync_failures -= 1
            fs.failed_fsyncs += 1
            raise StorageError(f"{self.path}: cannot fsync: {os.strerror(errno.EIO)} (injected)")
        self._inner.fsync(data_only=data_only)

    def size(self) -> int:
        return self._inner.size()

    def lock_exclusive(self) -> None:
        self._inner.lock_exclusive()

    def duplicate(self) -> File:
        return FaultyFile(self._fs, self._inner.duplicate())

    def close(self) -> None:
        self._inner.close()


class FaultyFsSync:
    """A syncfs handle of a :class:`FaultyFileSystem`: fails (syncing nothing) while the file system has data
    fsync failures armed, without consuming them, or syncfs failures armed (consuming one)."""

    __slots__ = ("_fs", "_inner")

    def __init__(self, fs: FaultyFileSystem, inner: FsSync) -> None:
        self._fs = fs
        self._inner = inner

    @property
    def path(self) -> str:
        return self._inner.path

    def syncfs(self) -> None:
        fs = self._fs
        fs.syncfs_calls += 1
        if fs.syncfs_failures > 0 or fs.fsync_failures > 0:
            fs.syncfs_failures = max(0, fs.syncfs_failures - 1)
            fs.failed_syncfs += 1
            raise StorageError(f"{self.path}: cannot syncfs: {os.strerror(errno.EIO)} (injected)")
        self._inner.syncfs()

    def close(self) -> None:
        self._inner.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m waltz.testing.faultfs [-v] --config FILE``: a storage node on a :class:`FaultyFileSystem`;
    SIGUSR1 fails its next data fsync."""
    from waltz.storage.config import StorageConfig
    from waltz.storage.startup import run_node

    parser = argparse.ArgumentParser(prog="python -m waltz.testing.faultfs", description=main.__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    config = StorageConfig.load(args.config)
    fs = FaultyFileSystem()

    def ready(node: Any) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, fs.fail_next_fsyncs)
        logging.getLogger(__name__).warning("test-only storage node: SIGUSR1 fails the next data fsync")
        print(json.dumps({"port": node.port, "admin_port": node.admin_port, "http_port": node.http_port}))
        sys.stdout.flush()

    asyncio.run(run_node(config, ready=ready, fs=fs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
