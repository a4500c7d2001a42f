"""The storage node's control file, ``<storage directory>/waltz-storage.ctl``.

All integers big-endian. Header (128 bytes)::

    offset  size  field
         0     4  i32 format version (1; 0 is read and migrated, see below)
         4     8  i64 creation time, ms since the epoch
        12     8  i64 cluster key, most significant half of the UUID
        20     8  i64 cluster key, least significant half
        28     4  i32 number of partitions
        32    96  zero padding (reserved)

Then, for partition ``p`` = 0 .. numPartitions-1, a PartitionInfo of 76 bytes at ``128 + 76·p``::

         0     4  i32 partition id (== p)
         4    36  struct A
        40    36  struct B

Each struct (36 bytes)::

         0     8  i64 session id
         8     8  i64 low-water mark        (cluster high-water mark when that session started)
        16     8  i64 local low-water mark  (this replica's max transaction id at that moment)
        24     4  i32 flags                 (1 = AVAILABLE, 4 = ASSIGNED, 8 = DAMAGED)
        28     4  i32 sequence number
        32     4  u32 checksum              CRC-32 of bytes 0..31 of the struct

Format 1 adds, after the last PartitionInfo, a TrimInfo of 32 bytes per partition at
``128 + 76·numPartitions + 32·p``: two structs (A at 0, B at 16) of 16 bytes each::

         0     8  i64 trim point           (the lowest transaction id this replica must still hold; 0 = none)
         8     4  i32 sequence number
        12     4  u32 checksum              CRC-32 of bytes 0..11 of the struct

A TrimInfo follows the PartitionInfo rules below (the verifying struct with the higher sequence number is
current; an update writes the other one), independently of the PartitionInfo: the trim point changes
without touching the session fields. A new TrimInfo is A = (0, seq -1), B = (0, seq 0). Golden bytes of
a struct with trim point 5 and sequence number 1: ``0000000000000005 00000001 ee5c5e3c`` (see the tests).

A format 0 file (the original's, no TrimInfo) is migrated when a node opens it: the whole file is written
again as format 1 (every trim point 0) to ``waltz-storage.ctl.tmp``, fsynced, renamed over the old one and
the directory fsynced, so a crash leaves either the old file or the new one, never a mix. One INFO line says
so. A node of format 0 refuses a format 1 file (unsupported version): upgrades are one-way.

A new file holds, for every partition, struct A = (-1, -1, -1, AVAILABLE, seq -1) and struct B =
(-1, -1, -1, AVAILABLE, seq 0). Of the structs whose checksum verifies, the one with the higher sequence
number is current; equal numbers or no valid struct raise :class:`~waltz.errors.CorruptionError`. An update
writes the *other* struct with sequence + 1 and fsyncs before returning, so a write torn by a crash fails its
checksum and the partition rolls back exactly one update.

DAMAGED (ours): the node found that this replica lost records it held (see
:mod:`waltz.storage.replica_check`); it stays set, across restarts, until the replica is repaired.

A storage node opens the file even when some partitions' entries do not verify (both structs bad, equal
sequence numbers, a wrong partition id): only those partitions are down (:attr:`ControlFile.damaged`; their
info reads as unassigned and updates are refused) until :meth:`ControlFile.reset` rewrites the entry fresh,
which the node does only when the replica is removed with its files. A damaged header still fails the open.

The file is created once (written to ``waltz-storage.ctl.tmp``, fsynced, renamed) with the cluster key and
partition count from ZooKeeper; every later open verifies both
(:class:`~waltz.errors.ClusterKeyMismatchError`).
While open it holds an exclusive ``flock`` so two storage processes cannot share a directory.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from waltz.errors import ClusterKeyMismatchError, CorruptionError, FormatVersionError, StorageError
from waltz.protocol.records import crc32
from waltz.storage.fileio import OS_FS, File, FileSystem, make_dirs_durable
from waltz.version import __version__

log = logging.getLogger(__name__)

CONTROL_FILE_NAME = "waltz-storage.ctl"
FORMAT_VERSION = 1
LEGACY_FORMAT_VERSION = 0
"""The original's format, without trim points: read, and migrated to :data:`FORMAT_VERSION` on open."""
HEADER_BYTES = 128
PARTITION_INFO_BYTES = 76
STRUCT_BYTES = 36
TRIM_INFO_BYTES = 32
TRIM_STRUCT_BYTES = 16
MAX_PARTITIONS = 1 << 16
"""Upper bound on the partition count a control file may hold (bounds the file to about 5 MB)."""

FLAG_AVAILABLE = 1
FLAG_ASSIGNED = 4
FLAG_DAMAGED = 8
"""The replica lost records it held and does not vote until repaired (see waltz.storage.replica_check)."""
_KNOWN_FLAGS = FLAG_AVAILABLE | FLAG_ASSIGNED | FLAG_DAMAGED
_I32_MAX = 2**31 - 1

_HEADER = struct.Struct(">iqqqi")
_STRUCT_BODY = struct.Struct(">qqqii")  # the 32 bytes covered by the checksum
_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_TRIM_BODY = struct.Struct(">qi")  # the 12 bytes of a TrimInfo struct covered by its checksum


@dataclass(frozen=True)
class ControlHeader:
    """The first 128 bytes of the control file."""

    version: int
    creation_time_ms: int
    key: uuid.UUID
    num_partitions: int

    def encode(self) -> bytes:
        msb, lsb = _uuid_halves(self.key)
        raw = _HEADER.pack(self.version, self.creation_time_ms, msb, lsb, self.num_partitions)
        return raw + bytes(HEADER_BYTES - len(raw))

    @classmethod
    def decode(cls, raw: bytes, path: str = CONTROL_FILE_NAME) -> ControlHeader:
        if len(raw) < HEADER_BYTES:
            raise CorruptionError(f"{path}: control file header is {len(raw)} bytes, expected {HEADER_BYTES}")
        version, created, msb, lsb, n = _HEADER.unpack_from(raw, 0)
        if version not in (FORMAT_VERSION, LEGACY_FORMAT_VERSION):
            raise FormatVersionError(
                f"{path}: control file format version {version}, but Waltz {__version__} reads versions "
                f"{LEGACY_FORMAT_VERSION} and {FORMAT_VERSION}: was it written by a newer release?"
            )
        if not 0 < n <= MAX_PARTITIONS:
            raise CorruptionError(f"{path}: bad partition count {n}")
        return cls(version, created, _uuid_from_halves(msb, lsb), n)


@dataclass(frozen=True)
class PartitionInfo:
    """The current store-session state of one partition on this node."""

    session_id: int = -1
    low_water_mark: int = -1
    local_low_water_mark: int = -1
    flags: int = FLAG_AVAILABLE

    @property
    def available(self) -> bool:
        return bool(self.flags & FLAG_AVAILABLE)

    @property
    def assigned(self) -> bool:
        return bool(self.flags & FLAG_ASSIGNED)

    @property
    def replica_damaged(self) -> bool:
        return bool(self.flags & FLAG_DAMAGED)


def encode_struct(info: PartitionInfo, sequence_number: int) -> bytes:
    """The 36 bytes of one PartitionInfo struct, checksum included."""
    try:
        body = _STRUCT_BODY.pack(
            info.session_id, info.low_water_mark, info.local_low_water_mark, info.flags, sequence_number
        )
    except struct.error:
        raise StorageError(f"partition info field out of range: {info!r} seq {sequence_number}") from None
    return body + _U32.pack(crc32(body))


def decode_struct(raw: bytes | memoryview) -> tuple[PartitionInfo, int] | None:
    """``(info, sequence_number)``, or None if the checksum does not verify."""
    body = raw[:32]
    if len(raw) != STRUCT_BYTES or _U32.unpack_from(raw, 32)[0] != crc32(body):
        return None
    session, lwm, llwm, flags, seq = _STRUCT_BODY.unpack_from(raw, 0)
    return PartitionInfo(session, lwm, llwm, flags), seq


def fresh_partition_info_bytes(partition_id: int) -> bytes:
    """A new PartitionInfo: both structs (-1, -1, -1, AVAILABLE), sequence numbers -1 (A) and 0 (B)."""
    fresh = PartitionInfo()
    return _I32.pack(partition_id) + encode_struct(fresh, -1) + encode_struct(fresh, 0)


def decode_partition_info(
    raw: bytes | memoryview, partition_id: int, path: str
) -> tuple[PartitionInfo, int, int]:
    """``(current info, its sequence number, its slot 0|1)`` of one 76-byte PartitionInfo."""
    if len(raw) != PARTITION_INFO_BYTES:
        raise CorruptionError(f"{path}: partition info {partition_id} is {len(raw)} bytes")
    (stored_id,) = _I32.unpack_from(raw, 0)
    if stored_id != partition_id:
        raise CorruptionError(f"{path}: partition info {partition_id} holds partition id {stored_id}")
    a = decode_struct(raw[4 : 4 + STRUCT_BYTES])
    b = decode_struct(raw[4 + STRUCT_BYTES :])
    if a is None and b is None:
        raise CorruptionError(
            f"{path}: partition info {partition_id} corrupted: both structs fail their checksum"
        )
    if a is not None and b is not None:
        if a[1] == b[1]:
            raise CorruptionError(f"{path}: partition info {partition_id}: both structs have sequence {a[1]}")
        return (a[0], a[1], 0) if a[1] > b[1] else (b[0], b[1], 1)
    if a is not None:
        log.warning("%s: partition %d: struct B fails its checksum; using struct A", path, partition_id)
        return a[0], a[1], 0
    assert b is not None
    log.warning("%s: partition %d: struct A fails its checksum; using struct B", path, partition_id)
    return b[0], b[1], 1


def encode_trim_struct(trim_point: int, sequence_number: int) -> bytes:
    """The 16 bytes of one TrimInfo struct, checksum included."""
    try:
        body = _TRIM_BODY.pack(trim_point, sequence_number)
    except struct.error:
        raise StorageError(f"trim point out of range: {trim_point} seq {sequence_number}") from None
    return body + _U32.pack(crc32(body))


def decode_trim_struct(raw: bytes | memoryview) -> tuple[int, int] | None:
    """``(trim_point, sequence_number)``, or None if the checksum does not verify."""
    if len(raw) != TRIM_STRUCT_BYTES or _U32.unpack_from(raw, 12)[0] != crc32(raw[:12]):
        return None
    trim, seq = _TRIM_BODY.unpack_from(raw, 0)
    return trim, seq


def fresh_trim_info_bytes() -> bytes:
    """A new TrimInfo: both structs trim point 0, sequence numbers -1 (A) and 0 (B)."""
    return encode_trim_struct(0, -1) + encode_trim_struct(0, 0)


def decode_trim_info(raw: bytes | memoryview, partition_id: int, path: str) -> tuple[int, int, int]:
    """``(current trim point, its sequence number, its slot 0|1)`` of one 32-byte TrimInfo."""
    a = decode_trim_struct(raw[:TRIM_STRUCT_BYTES])
    b = decode_trim_struct(raw[TRIM_STRUCT_BYTES:TRIM_INFO_BYTES])
    if a is None and b is None:
        raise CorruptionError(f"{path}: trim info {partition_id} corrupted: both structs fail their checksum")
    if a is not None and b is not None:
        if a[1] == b[1]:
            raise CorruptionError(f"{path}: trim info {partition_id}: both structs have sequence {a[1]}")
        return (a[0], a[1], 0) if a[1] > b[1] else (b[0], b[1], 1)
    if a is None:
        log.warning("%s: partition %d: trim struct A fails its checksum; using struct B", path, partition_id)
    else:
        log.warning("%s: partition %d: trim struct B fails its checksum; using struct A", path, partition_id)
    current = a if a is not None else b
    assert current is not None
    return current[0], current[1], 0 if a is not None else 1


def file_bytes(version: int, num_partitions: int) -> int:
    """The size of a control file of this format and partition count."""
    per_partition = PARTITION_INFO_BYTES + (TRIM_INFO_BYTES if version >= 1 else 0)
    return HEADER_BYTES + num_partitions * per_partition


def read_control_file(path: str, fs: FileSystem = OS_FS) -> tuple[ControlHeader, list[PartitionInfo]]:
    """Read and verify a control file without locking it (for tools; safe while a node runs)."""
    header, infos, _ = read_control_file_with_trims(path, fs)
    return header, infos


def read_control_file_with_trims(
    path: str, fs: FileSystem = OS_FS
) -> tuple[ControlHeader, list[PartitionInfo], list[int]]:
    """As :func:`read_control_file`, with each partition's trim point (0 in a format 0 file)."""
    f = fs.open(path, read_only=True)
    try:
        header, slots, trims = _load(f, path)
    finally:
        f.close()
    return header, [s[0] for s in slots], [t[0] for t in trims]


DAMAGED_INFO = PartitionInfo(flags=0)
"""What a damaged entry reads as: not assigned, not available, no session."""

_Slot = tuple[PartitionInfo, int, int]
_TrimSlot = tuple[int, int, int]


def _load(
    f: File, path: str, damaged: dict[int, str] | None = None
) -> tuple[ControlHeader, list[_Slot], list[_TrimSlot]]:
    """Header, current slots and trim slots; with ``damaged`` given, an entry that does not verify is
    recorded there (partition id -> reason) and read as :data:`DAMAGED_INFO` instead of failing the file."""
    header = ControlHeader.decode(f.pread(HEADER_BYTES, 0), path)
    n = header.num_partitions
    size = f.size()
    if size != file_bytes(header.version, n):
        raise CorruptionError(
            f"{path}: control file is {size} bytes, expected {file_bytes(header.version, n)} "
            f"for {n} partitions in format {header.version}"
        )
    body = memoryview(f.pread(size - HEADER_BYTES, HEADER_BYTES))
    trim_base = n * PARTITION_INFO_BYTES
    slots: list[_Slot] = []
    trims: list[_TrimSlot] = []
    for p in range(n):
        raw = body[p * PARTITION_INFO_BYTES : (p + 1) * PARTITION_INFO_BYTES]
        try:
            slot = decode_partition_info(raw, p, path)
            trim = (
                decode_trim_info(body[trim_base + p * TRIM_INFO_BYTES :][:TRIM_INFO_BYTES], p, path)
                if header.version >= 1
                else (0, 0, 1)
            )
        except CorruptionError as e:
            if damaged is None:
                raise
            damaged[p] = str(e)
            slot, trim = (DAMAGED_INFO, 0, 0), (0, 0, 1)
        slots.append(slot)
        trims.append(trim)
    return header, slots, trims


class ControlFile:
    """The open, locked control file. Not thread-safe: one owner (the storage node) calls it."""

    def __init__(
        self,
        path: str,
        f: File,
        header: ControlHeader,
        slots: list[_Slot],
        damaged: dict[int, str] | None = None,
        trims: list[_TrimSlot] | None = None,
    ):
        self.path = path
        self._file: File | None = f
        self.header = header
        self._slots = slots
        self._trims: list[_TrimSlot] = trims if trims is not None else [(0, 0, 1)] * len(slots)
        self.damaged: dict[int, str] = dict(damaged or {})
        """Partitions whose entry did not verify at open -> why (see the module docstring)."""

    @classmethod
    def open_or_create(
        cls,
        directory: str,
        key: uuid.UUID,
        num_partitions: int,
        *,
        fs: FileSystem = OS_FS,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> ControlFile:
        """Open ``<directory>/waltz-storage.ctl``, creating it on first start, and lock it.

        Raises ClusterKeyMismatchError if the file was made for another key or partition count, StorageError
        if another process holds the lock, CorruptionError if the file does not verify.
        """
        if not 0 < num_partitions <= MAX_PARTITIONS:
            raise StorageError(f"bad partition count {num_partitions}: must be 1..{MAX_PARTITIONS}")
        made = make_dirs_durable(fs, directory)
        path = os.path.join(directory, CONTROL_FILE_NAME)
        if not fs.exists(path):
            cls._create(fs, path, key, num_partitions, clock_ms())
            if not made:
                # Someone else made the directory (an installer, ``waltz local``): its own entry may not be
                # durable yet, and every partition directory and segment will live under it.
                fs.fsync_dir(os.path.dirname(os.path.normpath(directory)) or ".")
        f = fs.open(path)
        damaged: dict[int, str] = {}
        try:
            f.lock_exclusive()
            header, slots, trims = _load(f, path, damaged)
            if header.version == LEGACY_FORMAT_VERSION and header.key == key:
                f = cls._migrate(fs, path, f, header, slots)
                header, slots, trims = _load(f, path, damaged)
            if header.key != key:
                raise ClusterKeyMismatchError(f"{path}: cluster key {header.key} does not match {key}")
            if header.num_partitions != num_partitions:
                raise ClusterKeyMismatchError(
                    f"{path}: made for {header.num_partitions} partitions, the cluster has {num_partitions}"
                )
        except BaseException:
            f.close()
            raise
        for pid, reason in sorted(damaged.items()):
            log.error("%s: partition %d is down on this node: %s", path, pid, reason)
        return cls(path, f, header, slots, damaged, trims)

    @staticmethod
    def _migrate(fs: FileSystem, path: str, old: File, header: ControlHeader, slots: list[_Slot]) -> File:
        """Rewrite a locked format 0 file as format 1 (aside, fsynced, renamed, directory fsynced); returns
        the new file, locked. The PartitionInfo bytes are copied as they are, damaged entries included."""
        n = header.num_partitions
        raw = old.pread(HEADER_BYTES + n * PARTITION_INFO_BYTES, 0)
        new_header = replace(header, version=FORMAT_VERSION).encode()
        buf = bytearray(new_header) + raw[HEADER_BYTES:] + fresh_trim_info_bytes() * n
        tmp = path + ".tmp"
        f = fs.open(tmp, create=True)
        try:
            f.lock_exclusive()
            f.truncate(0)
            f.pwrite(buf, 0)
            f.fsync()
            fs.rename(tmp, path)
            fs.fsync_dir(os.path.dirname(path) or ".")
        except BaseException:
            f.close()
            raise
        old.close()
        log.info(
            "%s: migrated from format %d to %d (trim points, all 0)", path, header.version, FORMAT_VERSION
        )
        return f

    @staticmethod
    def _create(fs: FileSystem, path: str, key: uuid.UUID, num_partitions: int, now_ms: int) -> None:
        # Written aside and renamed, so a crash mid-creation never leaves a half-written control file.
        tmp = path + ".tmp"
        f = fs.open(tmp, create=True)
        try:
            f.lock_exclusive()
            buf = bytearray(ControlHeader(FORMAT_VERSION, now_ms, key, num_partitions).encode())
            for p in range(num_partitions):
                buf += fresh_partition_info_bytes(p)
            buf += fresh_trim_info_bytes() * num_partitions
            f.truncate(0)
            f.pwrite(buf, 0)
            f.fsync()
        finally:
            f.close()
        fs.rename(tmp, path)
        log.info("%s: created for cluster key %s with %d partitions", path, key, num_partitions)

    @property
    def key(self) -> uuid.UUID:
        return self.header.key

    @property
    def num_partitions(self) -> int:
        return self.header.num_partitions

    @property
    def creation_time_ms(self) -> int:
        return self.header.creation_time_ms

    def _check(self, partition_id: int) -> File:
        if self._file is None:
            raise StorageError(f"{self.path}: control file is closed")
        if not 0 <= partition_id < self.header.num_partitions:
            raise StorageError(f"partition {partition_id} out of range 0..{self.header.num_partitions - 1}")
        return self._file

    def partition_info(self, partition_id: int) -> PartitionInfo:
        self._check(partition_id)
        return self._slots[partition_id][0]

    def sequence_number(self, partition_id: int) -> int:
        """The sequence number of the current struct (for tests and tools)."""
        self._check(partition_id)
        return self._slots[partition_id][1]

    def update(
        self,
        partition_id: int,
        *,
        session_id: int | None = None,
        low_water_mark: int | None = None,
        local_low_water_mark: int | None = None,
        flags: int | None = None,
    ) -> PartitionInfo:
        """Change some fields of a partition's info; durable (fsynced) when this returns."""
        f = self._check(partition_id)
        if partition_id in self.damaged:
            raise CorruptionError(
                f"{self.path}: partition {partition_id}'s entry is damaged ({self.damaged[partition_id]}); "
                "remove the replica with its files to reset it"
            )
        current, seq, slot = self._slots[partition_id]
        changes: dict[str, int] = {}
        if session_id is not None:
            changes["session_id"] = session_id
        if low_water_mark is not None:
            changes["low_water_mark"] = low_water_mark
        if local_low_water_mark is not None:
            changes["local_low_water_mark"] = local_low_water_mark
        if flags is not None:
            if flags & ~_KNOWN_FLAGS:
                raise StorageError(f"unknown partition flags {flags:#x}")
            changes["flags"] = flags
        new = replace(current, **changes)
        if seq >= _I32_MAX:
            raise StorageError(f"{self.path}: partition {partition_id} sequence number exhausted")
        raw = encode_struct(new, seq + 1)
        # Verify right before the write: the encoding must read back as exactly what we mean to store.
        if decode_struct(raw) != (new, seq + 1):
            raise StorageError(f"partition info {partition_id} does not round-trip: {new!r}")
        other = 1 - slot
        offset = HEADER_BYTES + partition_id * PARTITION_INFO_BYTES + 4 + other * STRUCT_BYTES
        f.pwrite(raw, offset)
        f.fsync()
        self._slots[partition_id] = (new, seq + 1, other)
        return new

    def reset(self, partition_id: int) -> PartitionInfo:
        """Rewrite a partition's whole entry as new (both structs), durably; clears its damage. Only for a
        replica whose files are being deleted: the entry no longer describes anything."""
        f = self._check(partition_id)
        f.pwrite(fresh_partition_info_bytes(partition_id), HEADER_BYTES + partition_id * PARTITION_INFO_BYTES)
        f.pwrite(fresh_trim_info_bytes(), self._trim_offset(partition_id))
        f.fsync()
        self._slots[partition_id] = (PartitionInfo(), 0, 1)
        self._trims[partition_id] = (0, 0, 1)
        if self.damaged.pop(partition_id, None) is not None:
            log.info("%s: partition %d's damaged entry was reset", self.path, partition_id)
        return PartitionInfo()

    def _trim_offset(self, partition_id: int) -> int:
        n = self.header.num_partitions
        return HEADER_BYTES + n * PARTITION_INFO_BYTES + partition_id * TRIM_INFO_BYTES

    def trim_point(self, partition_id: int) -> int:
        """The lowest transaction id this replica must still hold (0: nothing trimmed)."""
        self._check(partition_id)
        return self._trims[partition_id][0]

    def set_trim_point(self, partition_id: int, trim_point: int) -> int:
        """Raise the partition's trim point; durable (fsynced) when this returns. A value at or below the
        current one changes nothing (trim points only move up); returns the trim point now in force."""
        f = self._check(partition_id)
        if partition_id in self.damaged:
            raise CorruptionError(
                f"{self.path}: partition {partition_id}'s entry is damaged ({self.damaged[partition_id]}); "
                "remove the replica with its files to reset it"
            )
        current, seq, slot = self._trims[partition_id]
        if trim_point <= current:
            return current
        if seq >= _I32_MAX:
            raise StorageError(f"{self.path}: partition {partition_id} trim sequence number exhausted")
        raw = encode_trim_struct(trim_point, seq + 1)
        if decode_trim_struct(raw) != (trim_point, seq + 1):
            raise StorageError(f"trim info {partition_id} does not round-trip: {trim_point}")
        other = 1 - slot
        f.pwrite(raw, self._trim_offset(partition_id) + other * TRIM_STRUCT_BYTES)
        f.fsync()
        self._trims[partition_id] = (trim_point, seq + 1, other)
        return trim_point

    def set_assigned(self, partition_id: int, assigned: bool) -> PartitionInfo:
        flags = self.partition_info(partition_id).flags
        return self.update(partition_id, flags=flags | FLAG_ASSIGNED if assigned else flags & ~FLAG_ASSIGNED)

    def set_available(self, partition_id: int, available: bool) -> PartitionInfo:
        flags = self.partition_info(partition_id).flags
        return self.update(
            partition_id, flags=flags | FLAG_AVAILABLE if available else flags & ~FLAG_AVAILABLE
        )

    def close(self) -> None:
        """Release the lock and the file; idempotent."""
        if self._file is not None:
            f, self._file = self._file, None
            f.close()

    def __enter__(self) -> ControlFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _uuid_halves(key: uuid.UUID) -> tuple[int, int]:
    """The UUID as two signed longs, as java.util.UUID stores it."""
    msb, lsb = key.int >> 64, key.int & ((1 << 64) - 1)
    return _signed64(msb), _signed64(lsb)


def _uuid_from_halves(msb: int, lsb: int) -> uuid.UUID:
    return uuid.UUID(int=((msb & ((1 << 64) - 1)) << 64) | (lsb & ((1 << 64) - 1)))


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v
