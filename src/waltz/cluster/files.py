"""Durable small files and directories for what Waltz lays out on disk outside the storage node: ZooKeeper's
directory (``zoo.cfg``, ``myid``, its data directory) and ``waltz local``'s cluster directory.

POSIX makes a file's data durable at the file's fsync and a directory entry durable at its parent
directory's fsync, nothing sooner. :func:`mkdir_durable` fsyncs the parent of every directory it creates;
:func:`write_durable` writes a file aside, fsyncs it, renames it over the old one and fsyncs the directory, so
a power cut leaves the old file or the new one, never a torn or missing one.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "mkdir_durable", "write_durable"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir_durable(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` and its missing parents, each new entry durable on return; True if any was made."""
    missing: list[Path] = []
    p = Path(path).absolute()
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    if not missing:
        return False
    Path(path).mkdir(parents=True, exist_ok=True)
    for d in reversed(missing):
        fsync_dir(d.parent)
    return True


def write_durable(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` by ``data`` atomically, durably: write aside, fsync, rename, fsync the directory."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT's mode does not apply to a leftover that already exists
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    fsync_dir(target.parent)
