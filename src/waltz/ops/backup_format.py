"""The backup format of ``waltz backup`` / ``waltz restore``: one directory per backup.

A backup directory holds one data file per partition and, written last, ``manifest.json``. A directory without
a manifest is a partial or interrupted backup and is never restored.

Partition file ``partition-<p>.wbk`` (big-endian)::

    offset  size  field
         0     8  magic b"WALTZBAK"
         8     2  u16 format version (1)
        10     2  u16 flags (0; a reader refuses any other value)
        12     4  i32 partition id
        16    16  cluster key (the UUID's 16 bytes)
        32     8  i64 first transaction id in the file (for a full backup the partition's trim point, 0 if
                  it was never trimmed; the previous backup's last + 1 for an incremental one)
        40     8  i64 last transaction id in the file (the cut's high-water mark; first - 1 if none)
        48     4  u32 CRC-32 of bytes 0..47
        52        blocks, then the end marker

    block:       u32 count (1..MAX_BLOCK_RECORDS) · u32 length (1..MAX_BLOCK_BYTES) · length bytes: a record
                 run of count records (:mod:`waltz.protocol.record_run`: each record ``40 + len`` bytes, ids
                 consecutive, continuing the previous block's; both CRC-32s of every record are checked when
                 the file is written and when it is read)
    end marker:  u32 0 · u32 0 · i64 number of records in the file (last - first + 1)

Nothing follows the end marker. A record's bytes are exactly those a storage node keeps in its segment data
file and sends in a record run, so a backup carries every field of every record (id, request id, header, data
and both checksums) as the log holds it.

``manifest.json`` (UTF-8 JSON object; written to ``manifest.json.tmp``, fsynced, renamed, directory fsynced)::

    format          "waltz-backup"
    version         1
    backup_id       UUID of this backup
    created_ms      wall-clock time of the cut, ms since the epoch
    cluster_name    the source cluster's name
    cluster_key     the source cluster's key (UUID)
    num_partitions  the source cluster's partition count
    parent          null for a full backup; for an incremental one {"backup_id", "manifest_sha256"}: the
                    previous backup's id and the SHA-256 (hex) of its manifest.json bytes
    partitions      one object per partition, by partition id:
                    {"partition", "file", "first", "last", "bytes", "sha256", "trim_point"}: the file's name,
                    its id range (as in its header), its size, the SHA-256 (hex) of the whole file, and the
                    partition's trim point when the backup was taken (0: never trimmed; a manifest without
                    the key reads as 0). A restore recreates the trim point (``docs/operations.md``).

The per-file SHA-256 can be checked with ``sha256sum``; ``waltz backup --verify`` checks it, every file's
header against the manifest, the blocks' shape and every record's checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from waltz.errors import BackupError, DataChecksumError, ProtocolError
from waltz.protocol.checksum import crc32
from waltz.protocol.record_run import run_bounds
from waltz.version import __version__

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_BLOCK_BYTES",
    "MAX_BLOCK_RECORDS",
    "BackupManifest",
    "FileHeader",
    "PartitionEntry",
    "PartitionFileWriter",
    "check_chain",
    "fsync_directory",
    "iter_blocks",
    "manifest_sha256",
    "partition_file_name",
    "read_manifest",
    "verify_backup",
    "write_manifest",
]

MAGIC = b"WALTZBAK"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "waltz-backup"
MAX_BLOCK_RECORDS = 10_000
"""Records in one block at most (what one range read returns at most)."""
MAX_BLOCK_BYTES = 256 * 1024 * 1024
"""Bytes in one block at most: what a reader holds in memory at once."""
READ_CHUNK_BYTES = 1024 * 1024

_HEADER = struct.Struct(">8sHHi16sqq")  # 48 bytes, then the u32 CRC-32
_HEADER_CRC = struct.Struct(">I")
HEADER_BYTES = _HEADER.size + _HEADER_CRC.size  # 52
_BLOCK = struct.Struct(">II")
_END_COUNT = struct.Struct(">q")


def partition_file_name(partition: int) -> str:
    return f"partition-{partition}.wbk"


@dataclass(frozen=True)
class FileHeader:
    partition: int
    cluster_key: uuid.UUID
    first: int
    last: int

    def encode(self) -> bytes:
        head = _HEADER.pack(
            MAGIC, FORMAT_VERSION, 0, self.partition, self.cluster_key.bytes, self.first, self.last
        )
        return head + _HEADER_CRC.pack(crc32(head))

    @classmethod
    def decode(cls, raw: bytes, path: Path) -> FileHeader:
        if len(raw) < HEADER_BYTES:
            raise BackupError(f"{path}: {len(raw)} bytes, too short for a backup file header")
        magic, version, flags, partition, key, first, last = _HEADER.unpack_from(raw, 0)
        if magic != MAGIC:
            raise BackupError(f"{path}: not a Waltz backup file (magic {magic!r})")
        if _HEADER_CRC.unpack_from(raw, _HEADER.size)[0] != crc32(raw[: _HEADER.size]):
            raise BackupError(f"{path}: the file header fails its checksum")
        if version != FORMAT_VERSION:
            raise BackupError(
                f"{path}: backup format version {version}, but Waltz {__version__} reads version "
                f"{FORMAT_VERSION}: was it written by a newer release?"
            )
        if flags != 0:
            raise BackupError(f"{path}: unknown backup file flags 0x{flags:x} (version {version} has none)")
        if first < 0 or last < first - 1:
            raise BackupError(f"{path}: impossible id range {first}..{last}")
        return cls(partition, uuid.UUID(bytes=key), first, last)


@dataclass(frozen=True)
class PartitionEntry:
    """One partition's line in the manifest."""

    partition: int
    file: str
    first: int
    last: int
    bytes: int
    sha256: str
    trim_point: int = 0
    """The partition's trim point when the backup was taken: the ids below it were deleted on purpose."""

    @property
    def records(self) -> int:
        return self.last - self.first + 1


@dataclass(frozen=True)
class BackupManifest:
    backup_id: uuid.UUID
    created_ms: int
    cluster_name: str
    cluster_key: uuid.UUID
    num_partitions: int
    parent: tuple[uuid.UUID, str] | None
    partitions: tuple[PartitionEntry, ...]

    def to_json(self) -> bytes:
        value: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "backup_id": str(self.backup_id),
            "created_ms": self.created_ms,
            "cluster_name": self.cluster_name,
            "cluster_key": str(self.cluster_key),
            "num_partitions": self.num_partitions,
            "parent": None
            if self.parent is None
            else {"backup_id": str(self.parent[0]), "manifest_sha256": self.parent[1]},
            "partitions": [
                {
                    "partition": e.partition,
                    "file": e.file,
                    "first": e.first,
                    "last": e.last,
                    "bytes": e.bytes,
                    "sha256": e.sha256,
                    "trim_point": e.trim_point,
                }
                for e in self.partitions
            ],
        }
        return (json.dumps(value, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, path: Path) -> BackupManifest:
        try:
            v = json.loads(raw)
            if v.get("format") != FORMAT_NAME or v.get("version") != FORMAT_VERSION:
                raise BackupError(
                    f"{path}: not a Waltz backup manifest of format version {FORMAT_VERSION} (it says "
                    f"{v.get('format')!r} version {v.get('version')!r}; Waltz {__version__} reads version "
                    f"{FORMAT_VERSION})"
                )
            parent = v["parent"]
            entries = tuple(
                PartitionEntry(
                    int(e["partition"]),
                    str(e["file"]),
                    int(e["first"]),
                    int(e["last"]),
                    int(e["bytes"]),
                    str(e["sha256"]),
                    int(e.get("trim_point", 0)),
                )
                for e in v["partitions"]
            )
            manifest = cls(
                uuid.UUID(v["backup_id"]),
                int(v["created_ms"]),
                str(v["cluster_name"]),
                uuid.UUID(v["cluster_key"]),
                int(v["num_partitions"]),
                None if parent is None else (uuid.UUID(parent["backup_id"]), str(parent["manifest_sha256"])),
                entries,
            )
        except BackupError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise BackupError(
                f"{path}: malformed backup manifest ({type(error).__name__}: {error})"
            ) from None
        if [e.partition for e in entries] != list(range(manifest.num_partitions)):
            raise BackupError(
                f"{path}: the manifest does not list partitions 0..{manifest.num_partitions - 1}"
            )
        for e in entries:
            if (
                e.file != partition_file_name(e.partition)
                or e.last < e.first - 1
                or e.first < 0
                or e.trim_point < 0
            ):
                raise BackupError(f"{path}: bad entry for partition {e.partition}")
        return manifest


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifest_sha256(directory: Path) -> str:
    return hashlib.sha256((directory / MANIFEST_NAME).read_bytes()).hexdigest()


def read_manifest(directory: Path) -> BackupManifest:
    """The manifest of the backup in ``directory``; BackupError naming the file if it is missing (a partial or
    interrupted backup) or unreadable."""
    path = directory / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        what = "no such directory" if not directory.is_dir() else "a partial or interrupted backup"
        raise BackupError(f"{path} does not exist: {what}") from None
    except OSError as e:
        raise BackupError(f"{path}: cannot read the manifest: {e}") from None
    return BackupManifest.from_json(raw, path)


def write_manifest(directory: Path, manifest: BackupManifest) -> None:
    """Write the manifest durably and atomically: the backup is complete once this returns."""
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with open(tmp, "wb") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)
    fsync_directory(directory)


class PartitionFileWriter:
    """Writes one partition file: header, blocks, end marker; hashes what it writes; fsyncs at
    :meth:`finish`."""

    def __init__(self, path: Path, header: FileHeader) -> None:
        self.path = path
        self.header = header
        self._file: BinaryIO = open(path, "xb")  # noqa: SIM115 - closed by finish/abort
        self._sha = hashlib.sha256()
        self._size = 0
        self._next = header.first
        self._write(header.encode())

    def _write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._sha.update(data)
        self._size += len(data)

    def add_run(self, first: int, count: int, run: bytes | memoryview) -> None:
        """Append a block; the run is verified whole (shape, ids, checksums) right before it is written."""
        if first != self._next or count < 1 or first + count - 1 > self.header.last:
            raise BackupError(f"{self.path}: a run of {count} from {first} does not continue at {self._next}")
        try:
            run_bounds(run, first, count)
        except (ProtocolError, DataChecksumError) as e:
            raise BackupError(
                f"partition {self.header.partition}: a run read from {first} fails: {e}"
            ) from None
        if count > MAX_BLOCK_RECORDS or len(run) > MAX_BLOCK_BYTES:
            raise BackupError(f"{self.path}: a block of {count} records, {len(run)} bytes is too large")
        self._write(_BLOCK.pack(count, len(run)))
        self._write(run)
        self._next += count

    def finish(self) -> PartitionEntry:
        if self._next != self.header.last + 1:
            raise BackupError(f"{self.path}: ends at {self._next - 1}, the cut is {self.header.last}")
        self._write(_BLOCK.pack(0, 0) + _END_COUNT.pack(self.header.last - self.header.first + 1))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return PartitionEntry(
            self.header.partition,
            self.path.name,
            self.header.first,
            self.header.last,
            self._size,
            self._sha.hexdigest(),
        )

    def abort(self) -> None:
        self._file.close()


def _read_exactly(f: BinaryIO, n: int, path: Path, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise BackupError(f"{path}: ends inside {what} (a partial or damaged file)")
    return data


def iter_blocks(
    path: Path, expected: PartitionEntry | None = None
) -> Iterator[tuple[FileHeader, int, int, bytes]]:
    """Yield ``(header, first, count, run)`` for every block of a partition file, each run verified whole (ids
    continuing, checksums); BackupError naming the file for anything wrong, including a missing end marker.
    Holds one block in memory at a time. With ``expected``, the header must match that manifest entry."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise BackupError(f"{path}: cannot open: {e}") from None
    with f:
        header = FileHeader.decode(f.read(HEADER_BYTES), path)
        if expected is not None and (
            header.partition != expected.partition
            or header.first != expected.first
            or header.last != expected.last
        ):
            raise BackupError(
                f"{path}: the header (partition {header.partition}, {header.first}..{header.last}) does not "
                f"match the manifest (partition {expected.partition}, {expected.first}..{expected.last})"
            )
        position = header.first
        while True:
            count, length = _BLOCK.unpack(_read_exactly(f, _BLOCK.size, path, "a block header"))
            if count == 0 and length == 0:
                (total,) = _END_COUNT.unpack(_read_exactly(f, _END_COUNT.size, path, "the end marker"))
                if position != header.last + 1 or total != header.last - header.first + 1:
                    raise BackupError(f"{path}: ends at {position - 1}, its header says {header.last}")
                if f.read(1):
                    raise BackupError(f"{path}: bytes after the end marker")
                return
            if not 1 <= count <= MAX_BLOCK_RECORDS or not 1 <= length <= MAX_BLOCK_BYTES:
                raise BackupError(f"{path}: a block of {count} records, {length} bytes at {position}")
            if position + count - 1 > header.last:
                raise BackupError(f"{path}: holds records past its last id {header.last}")
            run = _read_exactly(f, length, path, f"the block at transaction {position}")
            try:
                run_bounds(run, position, count)
            except (ProtocolError, DataChecksumError) as e:
                raise BackupError(f"{path}: the block at transaction {position} is damaged: {e}") from None
            yield header, position, count, run
            position += count


def file_sha256(path: Path) -> tuple[int, str]:
    sha = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(READ_CHUNK_BYTES):
                sha.update(chunk)
                size += len(chunk)
    except OSError as e:
        raise BackupError(f"{path}: cannot read: {e}") from None
    return size, sha.hexdigest()


def verify_backup(directory: Path, *, deep: bool = True) -> BackupManifest:
    """Check a backup whole: its manifest, every file's size and SHA-256 against it and (``deep``) every
    block and record. Returns the manifest; raises BackupError naming the first file that does not match."""
    manifest = read_manifest(directory)
    for entry in manifest.partitions:
        path = directory / entry.file
        size, digest = file_sha256(path)
        if size != entry.bytes or digest != entry.sha256:
            raise BackupError(
                f"{path}: does not match {directory / MANIFEST_NAME} (size {size}, SHA-256 {digest[:16]}..., "
                f"the manifest says {entry.bytes}, {entry.sha256[:16]}...)"
            )
        if deep:
            for header, *_ in iter_blocks(path, entry):
                if header.cluster_key != manifest.cluster_key:
                    raise BackupError(f"{path}: written for cluster {header.cluster_key}, not the manifest's")
    return manifest


def check_chain(directories: list[Path], manifests: list[BackupManifest]) -> None:
    """Check that ``manifests`` (of ``directories``, oldest first) form one chain: a full backup, then
    incremental ones each continuing the previous one, all of one cluster."""
    if not manifests:
        raise BackupError("no backup given")
    if manifests[0].parent is not None:
        raise BackupError(
            f"{directories[0] / MANIFEST_NAME} is an incremental backup: give its full backup (and the "
            "incremental ones between) before it"
        )
    for i in range(1, len(manifests)):
        prev, cur, path = manifests[i - 1], manifests[i], directories[i] / MANIFEST_NAME
        if cur.cluster_key != prev.cluster_key:
            raise BackupError(
                f"{path} is a backup of another cluster (key {cur.cluster_key}, not {prev.cluster_key})"
            )
        if cur.num_partitions != prev.num_partitions:
            raise BackupError(
                f"{path}: {cur.num_partitions} partitions, the previous backup has {prev.num_partitions}"
            )
        if cur.parent is None or cur.parent[0] != prev.backup_id:
            raise BackupError(f"{path} does not continue {directories[i - 1]} (its parent is another backup)")
        if cur.parent[1] != manifest_sha256(directories[i - 1]):
            raise BackupError(
                f"{directories[i - 1] / MANIFEST_NAME} was changed after {path} was taken from it"
            )
        for a, b in zip(prev.partitions, cur.partitions, strict=True):
            if b.first != a.last + 1:
                raise BackupError(f"{path}: partition {b.partition} starts at {b.first}, not {a.last + 1}")
