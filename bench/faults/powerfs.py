"""A FUSE filesystem that keeps POSIX's durability promise and nothing more: power cuts for the fault suite.

Semantics (what survives a cut):

* A file's **data and size** are durable once that file is fsynced (``fsync`` or ``fdatasync``, or a write
  through a descriptor opened with ``O_SYNC``/``O_DSYNC``): what it held at that moment survives, nothing
  written or truncated after it.
* A **directory entry** (create, mkdir, rename, unlink, rmdir, in either directory of a rename) is durable
  once its parent directory is fsynced: the fsync records the directory's whole name -> inode table as it is
  at that moment. A rename across directories is durable in each directory once that one is fsynced (only
  the target's fsync: the inode is in both; only the source's: in neither).
* A file whose entry is durable but whose data was never fsynced comes back empty; a directory whose entry is
  durable but which was never fsynced itself comes back empty. The mode of an entry is the one it had when
  its parent was fsynced. Times, owners and open descriptors are not kept.
* Everything else is volatile: it lives in this process's memory and is dropped when the process dies. A
  power cut is: kill -9 every process using the mount, kill -9 this process, unmount (lazily), mount again
  over the same backing directory (:class:`PowerMount`).
* ``--no-fsync`` makes fsync a no-op (it still succeeds): the negative control, where a cut drops everything
  written since the mount.
* ``--journal`` is the weaker model of ext4 and XFS in their default modes, for a program known not to fsync
  directories (ZooKeeper): an fsync of a file also makes every directory entry changed so far durable (it
  commits the filesystem's journal). Without it, the strict model above.

Not supported (``ENOTSUP``): hard links, symbolic links, special files, extended attributes. ``flock`` and
``fcntl`` locks are the kernel's (local to the mount, dropped with it).

The backing directory holds only the durable state, as an inode store (no byte of it changes except at an
fsync):

* ``dirs/<ino>.json``: a directory's entries as of its last fsync, ``{"entries": {name: [ino, st_mode]}}``;
  the root is inode 1 (``dirs/1.json``, absent means an empty root).
* ``data/<ino>``: a regular file's data as of its last fsync (absent means empty).

At mount, the tree reachable from the root is loaded (entries and sizes only; data is read from ``data/``
on demand) and every inode file it does not reach is deleted. :func:`import_tree` fills an empty backing
directory from an ordinary directory, everything in it durable.

In memory, a file is its durable data (``data/<ino>``, of ``durable_size`` bytes, of which only the first
``cut_to`` bytes still count after a truncation) overlaid with dirty 4 KiB pages; fsync writes the dirty
pages to ``data/<ino>``. The host's own filesystem holds the backing directory and is not cut, so the
backing files themselves need no fsync.

Run: ``python -m bench.faults.powerfs BACKING MOUNTPOINT [--no-fsync] [--import DIR]`` (in the foreground
until unmounted or killed).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAGE = 4096
ROOT_INO = 1
DIR_MODE = stat.S_IFDIR | 0o755


@dataclass(eq=False)
class Node:
    """One inode: a directory (``entries``) or a regular file (``size`` and dirty ``pages``)."""

    ino: int
    mode: int
    entries: dict[str, Node] = field(default_factory=dict)
    size: int = 0
    durable_size: int = 0
    """Bytes in ``data/<ino>`` (the size at the last fsync)."""
    cut_to: int = 0
    """Durable bytes at or past this offset were truncated away since the last fsync (read as zeros)."""
    pages: dict[int, bytearray] = field(default_factory=dict)
    mtime_ns: int = field(default_factory=time.time_ns)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


def _err(code: int) -> OSError:
    return OSError(code, os.strerror(code))


class PowerFs:
    """The filesystem's state and operations, by path (mfusepy's high-level interface); one lock for all."""

    use_ns = True

    def __init__(self, backing: Path, *, fsync_enabled: bool = True, journal: bool = False) -> None:
        self.backing = backing
        self.fsync_enabled = fsync_enabled
        self.journal = journal
        self.durable_entries: dict[int, dict[str, list[int]]] = {}
        """Each directory's entries as last written to ``dirs/`` (``--journal`` writes only changed ones)."""
        self._mutex = threading.Lock()
        (backing / "dirs").mkdir(parents=True, exist_ok=True)
        (backing / "data").mkdir(parents=True, exist_ok=True)
        self.root = Node(ROOT_INO, DIR_MODE)
        self.next_ino = ROOT_INO + 1
        self.handles: dict[int, tuple[Node, bool]] = {}
        """fh -> (node, writes are synchronous)."""
        self.next_fh = 1
        self._load()

    # -- the durable state -------------------------------------------------------------------------------

    def _load(self) -> None:
        seen: dict[int, Node] = {ROOT_INO: self.root}
        stack = [self.root]
        while stack:
            parent = stack.pop()
            path = self.backing / "dirs" / f"{parent.ino}.json"
            if not path.exists():
                continue
            entries = json.loads(path.read_text(encoding="utf-8"))["entries"]
            self.durable_entries[parent.ino] = entries
            for name, (ino, mode) in entries.items():
                node = seen.get(ino)
                if node is None:
                    node = seen[ino] = Node(ino, mode)
                    if node.is_dir:
                        stack.append(node)
                    else:
                        data = self.backing / "data" / str(ino)
                        node.size = node.durable_size = node.cut_to = (
                            data.stat().st_size if data.exists() else 0
                        )
                parent.entries[name] = node
        for kind in ("dirs", "data"):
            for path in (self.backing / kind).iterdir():
                ino = int(path.name.split(".")[0]) if path.name.split(".")[0].isdigit() else -1
                if ino not in seen:
                    path.unlink()
        self.next_ino = max(seen) + 1

    def _sync_file(self, node: Node) -> None:
        path = self.backing / "data" / str(node.ino)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if node.cut_to < node.durable_size:
                os.ftruncate(fd, node.cut_to)
            for index, page in sorted(node.pages.items()):
                offset = index * PAGE
                if offset < node.size:
                    os.pwrite(fd, bytes(page[: node.size - offset]), offset)
            os.ftruncate(fd, node.size)
        finally:
            os.close(fd)
        node.pages.clear()
        node.durable_size = node.cut_to = node.size

    def _sync_all_dirs(self) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            self._sync_dir(node)
            stack += [child for child in node.entries.values() if child.is_dir]

    def _sync_dir(self, node: Node) -> None:
        entries = {name: [child.ino, child.mode] for name, child in node.entries.items()}
        if self.durable_entries.get(node.ino) == entries:
            return
        self.durable_entries[node.ino] = entries
        path = self.backing / "dirs" / f"{node.ino}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"entries": entries}), encoding="utf-8")
        tmp.replace(path)

    # -- pages ---------------------------------------------------------------------------------------------

    def _page(self, node: Node, index: int) -> bytes | bytearray:
        page = node.pages.get(index)
        if page is not None:
            return page
        offset = index * PAGE
        durable = min(node.cut_to, node.durable_size) - offset
        if durable <= 0:
            return bytes(PAGE)
        with (self.backing / "data" / str(node.ino)).open("rb") as f:
            f.seek(offset)
            data = f.read(min(PAGE, durable))
        return data + bytes(PAGE - len(data))

    def _read(self, node: Node, size: int, offset: int) -> bytes:
        end = min(node.size, offset + size)
        out = bytearray()
        pos = offset
        while pos < end:
            index, within = divmod(pos, PAGE)
            take = min(PAGE - within, end - pos)
            out += self._page(node, index)[within : within + take]
            pos += take
        return bytes(out)

    def _write(self, node: Node, data: bytes, offset: int) -> None:
        pos, done = offset, 0
        while done < len(data):
            index, within = divmod(pos, PAGE)
            take = min(PAGE - within, len(data) - done)
            page = node.pages.get(index)
            if page is None:
                page = node.pages[index] = bytearray(self._page(node, index))
            page[within : within + take] = data[done : done + take]
            pos += take
            done += take
        node.size = max(node.size, offset + len(data))
        node.mtime_ns = time.time_ns()

    def _truncate(self, node: Node, length: int) -> None:
        if length < node.size:
            node.cut_to = min(node.cut_to, length)
            last, within = divmod(length, PAGE)
            for index in [i for i in node.pages if i > last or (i == last and within == 0)]:
                del node.pages[index]
            if within and last in node.pages:
                node.pages[last][within:] = bytes(PAGE - within)
        node.size = length
        node.mtime_ns = time.time_ns()

    # -- paths ---------------------------------------------------------------------------------------------

    def _lookup(self, path: str) -> Node:
        node = self.root
        for part in (p for p in path.split("/") if p):
            if not node.is_dir:
                raise _err(errno.ENOTDIR)
            child = node.entries.get(part)
            if child is None:
                raise _err(errno.ENOENT)
            node = child
        return node

    def _parent(self, path: str) -> tuple[Node, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        parent = self._lookup(head)
        if not parent.is_dir:
            raise _err(errno.ENOTDIR)
        return parent, name

    def _node(self, path: str | None, fh: int | None) -> Node:
        if fh is not None and fh in self.handles:
            return self.handles[fh][0]
        if path is None:
            raise _err(errno.EBADF)
        return self._lookup(path)

    def _new(self, mode: int) -> Node:
        node = Node(self.next_ino, mode)
        self.next_ino += 1
        return node

    def _open_fh(self, node: Node, flags: int) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = (node, bool(flags & (os.O_SYNC | os.O_DSYNC)))
        return fh

    # -- operations (mfusepy calls these; each raises OSError with an errno) ------------------------------

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        with self._mutex:
            node = self._node(path, fh)
            return {
                "st_mode": node.mode,
                "st_ino": node.ino,
                "st_nlink": 2 if node.is_dir else 1,
                "st_size": 4096 if node.is_dir else node.size,
                "st_blocks": (node.size + 511) // 512,
                "st_blksize": PAGE,
                "st_uid": os.getuid(),
                "st_gid": os.getgid(),
                "st_atime": node.mtime_ns,
                "st_mtime": node.mtime_ns,
                "st_ctime": node.mtime_ns,
            }

    def readdir(self, path: str, fh: int) -> list[str]:
        with self._mutex:
            node = self._lookup(path)
            return [".", "..", *node.entries]

    def mkdir(self, path: str, mode: int) -> int:
        return self._make(path, stat.S_IFDIR | (mode & 0o7777))

    def _make(self, path: str, mode: int) -> int:
        with self._mutex:
            parent, name = self._parent(path)
            if name in parent.entries:
                raise _err(errno.EEXIST)
            parent.entries[name] = self._new(mode)
            return 0

    def create(self, path: str, mode: int, flags: int = 0) -> int:
        with self._mutex:
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                node = parent.entries[name] = self._new(stat.S_IFREG | (mode & 0o7777))
            elif flags & os.O_EXCL:
                raise _err(errno.EEXIST)
            elif flags & os.O_TRUNC:
                self._truncate(node, 0)
            return self._open_fh(node, flags)

    def mknod(self, path: str, mode: int, dev: int) -> int:
        if not stat.S_ISREG(mode):
            raise _err(errno.ENOTSUP)
        return self._make(path, mode)

    def open(self, path: str, flags: int) -> int:
        with self._mutex:
            node = self._lookup(path)
            if flags & os.O_TRUNC:
                self._truncate(node, 0)
            return self._open_fh(node, flags)

    def opendir(self, path: str) -> int:
        with self._mutex:
            return self._open_fh(self._lookup(path), 0)

    def release(self, path: str | None, fh: int) -> int:
        with self._mutex:
            self.handles.pop(fh, None)
            return 0

    releasedir = release

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        with self._mutex:
            return self._read(self._node(path, fh), size, offset)

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        with self._mutex:
            node = self._node(path, fh)
            self._write(node, data, offset)
            if self.handles.get(fh, (node, False))[1] and self.fsync_enabled:
                self._sync_file(node)
                if self.journal:
                    self._sync_all_dirs()
            return len(data)

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        with self._mutex:
            node = self._node(path, fh)
            if node.is_dir:
                raise _err(errno.EISDIR)
            self._truncate(node, length)
            return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        with self._mutex:
            node = self._node(path, fh)
            if self.fsync_enabled and not node.is_dir:
                self._sync_file(node)
            if self.fsync_enabled and self.journal:
                self._sync_all_dirs()
            return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        with self._mutex:
            node = self._node(path, fh)
            if self.fsync_enabled:
                self._sync_dir(node)
            return 0

    def flush(self, path: str | None, fh: int) -> int:
        return 0

    def unlink(self, path: str) -> int:
        with self._mutex:
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                raise _err(errno.ENOENT)
            if node.is_dir:
                raise _err(errno.EISDIR)
            del parent.entries[name]
            return 0

    def rmdir(self, path: str) -> int:
        with self._mutex:
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                raise _err(errno.ENOENT)
            if not node.is_dir:
                raise _err(errno.ENOTDIR)
            if node.entries:
                raise _err(errno.ENOTEMPTY)
            del parent.entries[name]
            return 0

    def rename(self, old: str, new: str) -> int:
        with self._mutex:
            old_parent, old_name = self._parent(old)
            new_parent, new_name = self._parent(new)
            node = old_parent.entries.get(old_name)
            if node is None:
                raise _err(errno.ENOENT)
            target = new_parent.entries.get(new_name)
            if target is not None and target is not node:
                if target.is_dir and not node.is_dir:
                    raise _err(errno.EISDIR)
                if node.is_dir and not target.is_dir:
                    raise _err(errno.ENOTDIR)
                if target.is_dir and target.entries:
                    raise _err(errno.ENOTEMPTY)
            if node.is_dir and _contains(node, new_parent):
                raise _err(errno.EINVAL)
            del old_parent.entries[old_name]
            new_parent.entries[new_name] = node
            return 0

    def chmod(self, path: str, mode: int) -> int:
        with self._mutex:
            node = self._lookup(path)
            node.mode = stat.S_IFMT(node.mode) | (mode & 0o7777)
            return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        with self._mutex:
            node = self._lookup(path)
            node.mtime_ns = times[1] if times else time.time_ns()
            return 0

    def access(self, path: str, amode: int) -> int:
        with self._mutex:
            self._lookup(path)
            return 0

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self.backing)
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_namemax")
        return {k: getattr(st, k) for k in keys}

    def link(self, target: str, source: str) -> int:
        raise _err(errno.ENOTSUP)

    def symlink(self, target: str, source: str) -> int:
        raise _err(errno.ENOTSUP)


def _contains(tree: Node, node: Node) -> bool:
    """Whether ``node`` is ``tree`` or below it."""
    if tree is node:
        return True
    return any(_contains(child, node) for child in tree.entries.values() if child.is_dir)


def import_tree(source: Path, backing: Path) -> None:
    """Fill an empty backing directory with ``source``'s tree, all of it durable."""
    (backing / "dirs").mkdir(parents=True, exist_ok=True)
    (backing / "data").mkdir(parents=True, exist_ok=True)
    next_ino = ROOT_INO + 1

    def walk(directory: Path, ino: int) -> None:
        nonlocal next_ino
        entries: dict[str, list[int]] = {}
        for child in sorted(directory.iterdir()):
            st = child.lstat()
            child_ino = next_ino
            next_ino += 1
            if stat.S_ISDIR(st.st_mode):
                walk(child, child_ino)
            elif stat.S_ISREG(st.st_mode):
                shutil.copyfile(child, backing / "data" / str(child_ino))
            else:
                raise ValueError(f"{child}: only directories and regular files can be imported")
            entries[child.name] = [child_ino, st.st_mode]
        (backing / "dirs" / f"{ino}.json").write_text(json.dumps({"entries": entries}), encoding="utf-8")

    walk(source, ROOT_INO)


def serve(backing: Path, mountpoint: Path, *, fsync_enabled: bool = True, journal: bool = False) -> None:
    """Mount and serve in the foreground until unmounted (imports mfusepy only here: it needs libfuse)."""
    import mfusepy  # type: ignore[import-untyped]  # here: importing it loads libfuse

    fs = PowerFs(backing, fsync_enabled=fsync_enabled, journal=journal)
    mfusepy.FUSE(fs, str(mountpoint), foreground=True, nothreads=True, fsname="powerfs", auto_unmount=True)


# -- the harness's side: one mount as a child process --------------------------------------------------------


def mounted(mountpoint: Path) -> bool:
    """Whether ``mountpoint`` is a mount point now (from /proc/self/mountinfo, which also lists a mount whose
    FUSE process died, where ``os.path.ismount`` cannot stat)."""
    target = str(mountpoint.resolve())
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return any(line.split()[4] == target for line in f)


class PowerMount:
    """A :mod:`powerfs` mount served by a child process: :meth:`start`, :meth:`cut` (drop what is not durable
    and mount again), :meth:`stop`."""

    def __init__(
        self, backing: Path, mountpoint: Path, log: Path, *, fsync_enabled: bool = True, journal: bool = False
    ) -> None:
        self.backing = backing
        self.mountpoint = mountpoint
        self.log = log
        self.fsync_enabled = fsync_enabled
        self.journal = journal
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "bench.faults.powerfs", str(self.backing), str(self.mountpoint)]
        if not self.fsync_enabled:
            cmd.append("--no-fsync")
        if self.journal:
            cmd.append("--journal")
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while not (mounted(self.mountpoint) and os.path.ismount(self.mountpoint)):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"powerfs on {self.mountpoint} exited with {self.proc.returncode}; see {self.log}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"powerfs on {self.mountpoint} not mounted within {timeout_s:g}s")
            time.sleep(0.05)

    def _kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None
        deadline = time.monotonic() + 10
        while mounted(self.mountpoint):
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, check=False)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.mountpoint} still mounted 10 s after its powerfs died")
            time.sleep(0.05)

    def cut(self) -> None:
        """The power cut (the caller killed every process using the mount first): kill -9 the filesystem,
        which drops everything not yet durable, and mount the durable state again."""
        self._kill()
        self.start()

    def stop(self) -> None:
        """Unmount and stop (what is not durable is dropped, as at a cut)."""
        self._kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="powerfs: a FUSE filesystem that drops what is not durable")
    parser.add_argument("backing", type=Path)
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--no-fsync", action="store_true", help="fsync does nothing (the negative control)")
    parser.add_argument("--journal", action="store_true", help="a file's fsync also commits every entry")
    parser.add_argument(
        "--import", dest="source", type=Path, help="fill an empty BACKING from this tree first"
    )
    args = parser.parse_args(argv)
    if args.source is not None:
        import_tree(args.source, args.backing)
    serve(args.backing, args.mountpoint, fsync_enabled=not args.no_fsync, journal=args.journal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
