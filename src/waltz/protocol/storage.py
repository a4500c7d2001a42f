"""Server <-> storage node messages (frame magic 'S', codec version V0), sans-I/O.

Every payload starts with the same prefix (big-endian; primitives as in :mod:`waltz.protocol.wire`)::

    u8  type · i64 session_id · i64 seq_num · i32 partition_id

Responses echo the request's prefix; the client matches them to requests by ``seq_num`` (a per-connection
counter). The fields after the prefix, by type code:

====  =========================  ===================================================================
code  message                    fields after the prefix
====  =========================  ===================================================================
1     OpenRequest                uuid cluster_key · i32 num_partitions  (prefix -1, -1, -1)
2     LastSessionInfoRequest     bool used_by_offline_recovery
3     LastSessionInfoResponse    i64 session_id · i64 low_water_mark · i64 local_low_water_mark
                                 · [u8 replica_flags]   (the bracketed trailer is ours, see below)
4     SetLowWaterMarkRequest     i64 low_water_mark · bool offline
5     TruncateRequest            i64 transaction_id (keep ids <= this) · bool offline
                                 · [u8 truncate_flags · string reason]   (trailer ours, see below)
                                 (answered by MaxTransactionIdResponse with the new max id)
6     AppendRequest              i32 n · n x Record · bool offline
7     SuccessResponse            -
8     FailureResponse            StorageRpcException (:mod:`waltz.protocol.rpc_failure`)
9     RecordHeaderRequest        i64 transaction_id
10    RecordHeaderResponse       bool present · [RecordHeader if present]
11    RecordRequest              i64 transaction_id
12    RecordResponse             bool present · [Record if present]
13    MaxTransactionIdRequest    bool offline
14    MaxTransactionIdResponse   i64 transaction_id
15    RecordHeaderListRequest    i64 transaction_id · i32 max_records
16    RecordHeaderListResponse   i32 n · n x RecordHeader
17    RecordListRequest          i64 transaction_id · i32 max_records
18    RecordListResponse         i32 n · n x Record
19    RecordRunRequest           i64 transaction_id · i32 max_records · i32 max_bytes   (ours)
20    RecordRunResponse          i32 n · bytes run: n records as stored (ours)
21    RepairRequest              i32 n · n x Record   (ours; answered by Success)
22    DamagedRecordsRequest      i32 max_ids   (ours)
23    DamagedRecordsResponse     i32 n · n x i64 transaction_id   (ours)
24    TrimRequest                i64 trim_point · bool offline   (ours)
25    TrimResponse               i64 trim_point   (ours: the trim point now in force on the replica)
26    SegmentSizesRequest        i32 max_segments   (ours, V1)
27    SegmentSizesResponse       i32 n · n x (i64 first_transaction_id · i64 bytes)   (ours, V1)
====  =========================  ===================================================================

Versions: V0 is every message above, as Waltz 0.1.0 (the first release) speaks them: the original's 1-18
and our 19-25, which were added before that release and which every 0.1.0 node understands, so they need no
version of their own (a node older than 0.1.0 is not a release and is not supported). The hello picks the
highest version both ends list (:mod:`waltz.protocol.framing`; with none in common each end reports both
lists). From V1 on, a new message type is a new codec version: its class sets ``MIN_VERSION``, the sender
checks :func:`available` with the connection's negotiated version once, before it builds such a request,
and the decoder refuses it below its version. The hot path (appends, run reads) is V0 and checks nothing.
V1 (Waltz 0.2.0) adds 26/27. V2 adds 28, ``MultiAppendRequest`` (several partitions' appends in one frame,
each answered as above), defined in :mod:`waltz.protocol.storage_multi`, whose ``decode`` is a storage node's
request decoder; a server sends it only once the cluster's feature version allows (see there).

The bracketed trailers of 3 and 5 are not the original's. Each is sent only when it says something (a
flag set or a reason given) and a message without it decodes as if it were all zero, so the original's
messages and ours without a trailer are byte for byte the same. A decoder older than the trailer refuses a
message that carries one (trailing bytes), which fails safe: that peer treats the replica as failed.

* LastSessionInfoResponse ``replica_flags``: bit 0 (:data:`REPLICA_DAMAGED`, 0x01) says the replica lost
  records its control file says it held (a partition directory or segments missing, its max id below its
  local low-water mark: after a power cut, say). Recovery does not count it in a vote until the node
  reports it repaired (see ``docs/replication.md``). Other bits are 0; a decoder refuses unknown bits.
* TruncateRequest ``truncate_flags``: bit 0 (:data:`TRUNCATE_OPERATOR_REPAIR`, 0x01) lets the truncation go
  below the replica's persisted low-water mark, which the node otherwise refuses (those records were
  committed); only the operator's repair tools (``waltz.ops``) set it. Other bits are 0; a decoder refuses
  unknown bits. ``reason`` (UTF-8, at most :data:`MAX_TRUNCATE_REASON_BYTES` bytes, not null) says why, for
  the node's INFO line about the truncation.

Golden bytes: ``TruncateRequest(5, 6, 7, 99, False, operator_repair=True, reason="x")`` is
``05 0000000000000005 0000000000000006 00000007 0000000000000063 00 01 00000001 78``.

21 is not the original's either: good copies of records a replica reported damaged (a read failed there with
CorruptionError). The node overwrites a stored record only if it does not verify and the copy does, with the
same id and stored length; see ``PartitionLog.repair``.

22/23 are not the original's either: the ids of stored records the node found damaged (by a read or by its
background scrub) and not repaired yet, lowest first, at most ``max_ids``. The owner server asks each
participant now and then, so damage nobody read is repaired too (see ``StoreSession``).

24/25 are not the original's either. The trim point is the lowest transaction id the replica must
still hold. The node persists it in its control file before answering (only upwards: a lower one is answered
with the one in force), refuses one above its durable max id + 1, deletes the segments wholly below it in
the background and fails every read below it with ``TrimmedError`` (see :mod:`waltz.storage.retention`).
Golden bytes:
``TrimRequest(5, 6, 7, 100, False)`` is ``18 0000000000000005 0000000000000006 00000007 0000000000000064 00``.

26/27 (ours, V1): a replica's newest segments and their sizes, for a retention limit in bytes; see
``docs/formats.md`` ("Wire protocols") and :mod:`waltz.server.retention`.

19/20 are not the original's: a bulk read that returns consecutive records exactly as the data file holds
them (a *record run*, :mod:`waltz.protocol.record_run`), read with one ``pread`` and not decoded by the node;
at least one record, at most ``max_records`` and, beyond the first, ``max_bytes``; it stops at the end of a
segment. The decoder checks the run's shape (ids consecutive from the first record's, lengths inside the run,
nothing left over), not its checksums, which the final reader verifies.

``Record`` and ``RecordHeader`` are laid out as in :mod:`waltz.protocol.records` (36 + data and 28 bytes),
their lists as in :mod:`waltz.protocol.record_list`. The codec does not verify record checksums: the storage
node verifies each record right before writing it, and readers right after reading it, which is where a
mismatch can be acted on.

Every decoder returns a whole message or raises :class:`~waltz.errors.RemoteProtocolError` (unknown type,
truncation, trailing bytes, a count the payload cannot hold); no count is trusted before it is checked
against the bytes that remain. Encoders raise :class:`~waltz.errors.LocalProtocolError` for values a field
cannot carry. Sequences decode as tuples.
"""

from __future__ import annotations

import operator
import struct
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, NamedTuple, Self

from waltz.errors import LocalProtocolError, RemoteProtocolError, WaltzError, error_from_wire
from waltz.protocol.record_list import (
    WireRecordList,
    read_header_list,
    read_record_list,
    read_wire_record_list,
    write_header_list,
    write_record_list,
)
from waltz.protocol.record_run import STORED_OVERHEAD_BYTES, RunBytes, run_first_id
from waltz.protocol.records import (
    Record,
    RecordHeader,
    read_record,
    read_record_header,
    write_record,
    write_record_header,
)
from waltz.protocol.rpc_failure import (
    MAX_FAILURE_FRAMES,
    StackFrame,
    StorageRpcFailure,
    read_failure,
    rpc_failure_of,
    write_failure,
)
from waltz.protocol.wire import I32, I32_MAX, Reader, Writer

__all__ = [
    "MAX_FAILURE_FRAMES",
    "MAX_TRUNCATE_REASON_BYTES",
    "REPLICA_DAMAGED",
    "TRUNCATE_OPERATOR_REPAIR",
    "STORAGE_CLIENT_HELLO",
    "STORAGE_SERVER_HELLO",
    "STORAGE_VERSIONS",
    "AppendRequest",
    "DamagedRecordsRequest",
    "DamagedRecordsResponse",
    "MAX_SEGMENT_SIZES",
    "SegmentSizesRequest",
    "SegmentSizesResponse",
    "FailureResponse",
    "LastSessionInfoRequest",
    "LastSessionInfoResponse",
    "MaxTransactionIdRequest",
    "MaxTransactionIdResponse",
    "OpenRequest",
    "RecordHeaderListRequest",
    "RecordHeaderListResponse",
    "RecordHeaderRequest",
    "RecordHeaderResponse",
    "RecordListRequest",
    "RecordListResponse",
    "RecordRequest",
    "RecordResponse",
    "RecordRunRequest",
    "RecordRunResponse",
    "RepairRequest",
    "SessionInfo",
    "SetLowWaterMarkRequest",
    "StackFrame",
    "StorageMessage",
    "StorageRpcFailure",
    "SuccessResponse",
    "TrimRequest",
    "TrimResponse",
    "TruncateRequest",
    "WireRecordList",
    "available",
    "decode",
    "encode",
    "encode_record_run_response",
    "record_run_response_parts",
    "encode_success",
    "failure_from_error",
    "failure_to_error",
    "read_failure",
    "read_record_list",
    "read_session_info",
    "read_wire_record_list",
    "rpc_failure_of",
    "seq_num_of",
    "write_failure",
    "write_record_list",
    "write_session_info",
]

STORAGE_VERSIONS: Final = (0, 1, 2)
"""Codec versions of the storage protocol this implementation speaks (frame magic 'S')."""
STORAGE_CLIENT_HELLO: Final = "Waltz Storage Client"
STORAGE_SERVER_HELLO: Final = "Waltz Storage Server"


PREFIX: Final = struct.Struct(">Bqqi")
_RUN_RESPONSE_HEAD: Final = struct.Struct(">Bqqiii")  # the prefix, count, the run's byte length

REPLICA_DAMAGED: Final = 0x01
"""LastSessionInfoResponse replica flag: the replica lost records it held; it must not vote (see above)."""
TRUNCATE_OPERATOR_REPAIR: Final = 0x01
"""TruncateRequest flag: an operator's repair may truncate below the persisted low-water mark."""
MAX_TRUNCATE_REASON_BYTES: Final = 256
"""Longest reason a TruncateRequest may carry (UTF-8 bytes)."""


class SessionInfo(NamedTuple):
    """What a storage partition's control file says about the newest store session that wrote it, and whether
    the node found the replica damaged (it lost records it held; see the module docstring)."""

    session_id: int
    low_water_mark: int
    local_low_water_mark: int
    damaged: bool = False


@dataclass(frozen=True, slots=True)
class StorageMessage:
    """Base of every storage message: the common prefix. ``TYPE`` is the wire type code."""

    TYPE: ClassVar[int] = 0
    MIN_VERSION: ClassVar[int] = 0
    """The first codec version that has this message (see the module's "Versions")."""

    session_id: int
    seq_num: int
    partition_id: int

    def _write(self, w: Writer) -> None:
        """Append the fields after the prefix (none for the base)."""

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id)


@dataclass(frozen=True, slots=True)
class OpenRequest(StorageMessage):
    """First request on a connection: the storage node checks the cluster key and partition count."""

    TYPE: ClassVar[int] = 1

    cluster_key: uuid.UUID
    num_partitions: int

    @classmethod
    def of(cls, cluster_key: uuid.UUID, num_partitions: int) -> OpenRequest:
        """An OpenRequest with the conventional prefix (-1, -1, -1); its reply carries the same prefix."""
        return cls(-1, -1, -1, cluster_key, num_partitions)

    def _write(self, w: Writer) -> None:
        w.uuid(self.cluster_key).i32(self.num_partitions)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.uuid(), r.i32())


@dataclass(frozen=True, slots=True)
class LastSessionInfoRequest(StorageMessage):
    """Ask for the partition's persisted session info (offline recovery needs the partition unavailable)."""

    TYPE: ClassVar[int] = 2

    used_by_offline_recovery: bool

    def _write(self, w: Writer) -> None:
        w.bool(self.used_by_offline_recovery)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.bool())


@dataclass(frozen=True, slots=True)
class LastSessionInfoResponse(StorageMessage):
    """The partition's persisted (session id, low-water mark, local low-water mark)."""

    TYPE: ClassVar[int] = 3

    info: SessionInfo

    def _write(self, w: Writer) -> None:
        write_session_info(w, self.info)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, read_session_info(r))


def write_session_info(w: Writer, info: SessionInfo) -> None:
    """``i64 session_id · i64 low_water_mark · i64 local_low_water_mark · [u8 replica_flags]``, the trailer
    only when the replica is damaged (the data port's LastSessionInfoResponse, and the admin port's)."""
    w.i64(info.session_id).i64(info.low_water_mark).i64(info.local_low_water_mark)
    if info.damaged:
        w.u8(REPLICA_DAMAGED)


def read_session_info(r: Reader) -> SessionInfo:
    """The inverse of :func:`write_session_info`; the trailer, if any, ends the message."""
    sid, lwm, llwm = r.i64(), r.i64(), r.i64()
    flags = 0
    if r.remaining():
        flags = r.u8()
        if flags == 0:
            raise RemoteProtocolError("1 trailing byte: an empty replica-flags trailer is never sent")
        if flags & ~REPLICA_DAMAGED:
            raise RemoteProtocolError(f"unknown replica flags {flags:#x}")
    return SessionInfo(sid, lwm, llwm, bool(flags & REPLICA_DAMAGED))


@dataclass(frozen=True, slots=True)
class SetLowWaterMarkRequest(StorageMessage):
    """Persist the session's low-water mark (after fsync); answered by Success."""

    TYPE: ClassVar[int] = 4

    low_water_mark: int
    offline: bool

    def _write(self, w: Writer) -> None:
        w.i64(self.low_water_mark).bool(self.offline)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i64(), r.bool())


@dataclass(frozen=True, slots=True)
class TruncateRequest(StorageMessage):
    """Drop every record after ``transaction_id``; answered by MaxTransactionIdResponse (the new max id).

    The node refuses to go below the replica's persisted low-water mark unless ``operator_repair`` is set
    (only the operator's repair tools set it); ``reason`` says why, for the node's log (see the module
    docstring)."""

    TYPE: ClassVar[int] = 5

    transaction_id: int
    offline: bool
    operator_repair: bool = False
    reason: str = ""

    def _write(self, w: Writer) -> None:
        w.i64(self.transaction_id).bool(self.offline)
        if self.operator_repair or self.reason:
            raw = self.reason.encode("utf-8")
            if len(raw) > MAX_TRUNCATE_REASON_BYTES:
                raise LocalProtocolError(
                    f"truncate reason is {len(raw)} bytes, at most {MAX_TRUNCATE_REASON_BYTES} allowed"
                )
            w.u8(TRUNCATE_OPERATOR_REPAIR if self.operator_repair else 0).bytes_(raw)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        txn, offline = r.i64(), r.bool()
        if not r.remaining():
            return cls(session_id, seq_num, partition_id, txn, offline)
        if r.remaining() < 5:
            raise RemoteProtocolError(f"{r.remaining()} trailing bytes: too short for the truncate trailer")
        flags = r.u8()
        if flags & ~TRUNCATE_OPERATOR_REPAIR:
            raise RemoteProtocolError(f"unknown truncate flags {flags:#x}")
        raw = r.bytes_()
        if raw is None or len(raw) > MAX_TRUNCATE_REASON_BYTES:
            raise RemoteProtocolError(
                f"truncate reason must be 0..{MAX_TRUNCATE_REASON_BYTES} bytes, not "
                + ("null" if raw is None else f"{len(raw)}")
            )
        try:
            reason = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError("truncate reason is not UTF-8") from None
        if not flags and not reason:
            raise RemoteProtocolError("5 trailing bytes: an empty truncate trailer is never sent")
        return cls(
            session_id, seq_num, partition_id, txn, offline, bool(flags & TRUNCATE_OPERATOR_REPAIR), reason
        )


@dataclass(frozen=True, slots=True)
class AppendRequest(StorageMessage):
    """Append a batch of records that continues the log densely; answered by Success once fsynced."""

    TYPE: ClassVar[int] = 6

    records: Sequence[Record]
    offline: bool

    def _write(self, w: Writer) -> None:
        write_record_list(w, self.records)
        w.bool(self.offline)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        # Kept as received: the storage node writes these bytes without a Record per record.
        return cls(session_id, seq_num, partition_id, read_wire_record_list(r), r.bool())


@dataclass(frozen=True, slots=True)
class SuccessResponse(StorageMessage):
    """The request succeeded."""

    TYPE: ClassVar[int] = 7


@dataclass(frozen=True, slots=True)
class FailureResponse(StorageMessage):
    """The request failed; :func:`failure_to_error` turns it back into a Waltz error."""

    TYPE: ClassVar[int] = 8

    failure: StorageRpcFailure

    def _write(self, w: Writer) -> None:
        write_failure(w, self.failure)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, read_failure(r))


@dataclass(frozen=True, slots=True)
class RecordHeaderRequest(StorageMessage):
    TYPE: ClassVar[int] = 9

    transaction_id: int

    def _write(self, w: Writer) -> None:
        w.i64(self.transaction_id)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i64())


@dataclass(frozen=True, slots=True)
class RecordHeaderResponse(StorageMessage):
    """``header`` is None if the storage node does not have that transaction."""

    TYPE: ClassVar[int] = 10

    header: RecordHeader | None

    def _write(self, w: Writer) -> None:
        w.bool(self.header is not None)
        if self.header is not None:
            write_record_header(w, self.header)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, read_record_header(r) if r.bool() else None)


@dataclass(frozen=True, slots=True)
class RecordRequest(StorageMessage):
    TYPE: ClassVar[int] = 11

    transaction_id: int

    def _write(self, w: Writer) -> None:
        w.i64(self.transaction_id)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i64())


@dataclass(frozen=True, slots=True)
class RecordResponse(StorageMessage):
    """``record`` is None if the storage node does not have that transaction."""

    TYPE: ClassVar[int] = 12

    record: Record | None

    def _write(self, w: Writer) -> None:
        w.bool(self.record is not None)
        if self.record is not None:
            write_record(w, self.record)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, read_record(r) if r.bool() else None)


@dataclass(frozen=True, slots=True)
class MaxTransactionIdRequest(StorageMessage):
    TYPE: ClassVar[int] = 13

    offline: bool

    def _write(self, w: Writer) -> None:
        w.bool(self.offline)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.bool())


@dataclass(frozen=True, slots=True)
class MaxTransactionIdResponse(StorageMessage):
    """The partition's highest stored transaction id (-1 for an empty partition)."""

    TYPE: ClassVar[int] = 14

    transaction_id: int

    def _write(self, w: Writer) -> None:
        w.i64(self.transaction_id)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i64())


@dataclass(frozen=True, slots=True)
class RecordHeaderListRequest(StorageMessage):
    """Consecutive headers from ``transaction_id``, at most ``max_records``, stopping at the first gap."""

    TYPE: ClassVar[int] = 15

    transaction_id: int
    max_records: int

    def _write(self, w: Writer) -> None:
        w.i64(self.transaction_id).i32(self.max_records)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i64(), r.i32())


@dataclass(frozen=True, slots=True)
class RecordHeaderListResponse(StorageMessage):
    TYPE: ClassVar[int] = 16

    headers: Sequence[RecordHeader]

    def _write(self, w: Writer) -> None:
        write_header_list(w, self.headers)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, read_header_list(r))


@dataclass(frozen=True, slots=True)
class RecordListRequest(StorageMessage):
    """Consecutive records from ``transaction_id``, at most ``max_records``, stopping at the first gap."""

    TYPE: ClassVar[int] = 17

    transaction_id: int
    max_records: int

    def _write(self, w: Writer) -> None:
        w.i64(self.transaction_id).i32(self.max_records)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i64(), r.i32())


@dataclass(frozen=True, slots=True)
class RecordListResponse(StorageMessage):
    TYPE: ClassVar[int] = 18

    records: Sequence[Record]

    def _write(self, w: Writer) -> None:
        write_record_list(w, self.records)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, read_record_list(r))


@dataclass(frozen=True, slots=True)
class RecordRunRequest(StorageMessage):
    """Consecutive records from ``transaction_id`` as stored: at most ``max_records``, and at most
    ``max_bytes`` beyond the first record (ours)."""

    TYPE: ClassVar[int] = 19

    transaction_id: int
    max_records: int
    max_bytes: int

    def _write(self, w: Writer) -> None:
        w.i64(self.transaction_id).i32(self.max_records).i32(self.max_bytes)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i64(), r.i32(), r.i32())


@dataclass(frozen=True, slots=True)
class RecordRunResponse(StorageMessage):
    """``count`` records as stored, from the id of the first (``first``, -1 when empty) (ours)."""

    TYPE: ClassVar[int] = 20

    count: int
    run: RunBytes
    """A view of the received payload when decoded (see :data:`~waltz.protocol.record_run.RunBytes`)."""

    @property
    def first(self) -> int:
        return run_first_id(self.run) if self.count else -1

    def _write(self, w: Writer) -> None:
        w.i32(self.count).bytes_(self.run)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        count = r.i32()
        run = r.bytes_view_required()  # relayed by the server as it is: not copied out of the payload
        if count:
            if count < 0 or count * STORED_OVERHEAD_BYTES > len(run):
                raise RemoteProtocolError(f"a run of {len(run)} bytes cannot hold {count} records")
            run_first_id(run)
        elif run:
            raise RemoteProtocolError(f"an empty run carries {len(run)} bytes")
        # The rest of the run's shape (ids in sequence, lengths) is not walked here: the one consumer of a
        # run is a server relaying it to a reader, and every reader unpacks it with run_bounds, which checks
        # the shape and both checksums of every record in the pass it makes anyway. The storage node checked
        # each record's id and checksum right after reading it (Segment.read_run). A walk here cost the
        # server ~0.2 us per relayed record, a fifth of its CPU in a bulk read.
        return cls(session_id, seq_num, partition_id, count, run)


@dataclass(frozen=True, slots=True)
class RepairRequest(StorageMessage):
    """Good copies of committed records to overwrite damaged ones with (see the module docstring)."""

    TYPE: ClassVar[int] = 21

    records: Sequence[Record]

    def _write(self, w: Writer) -> None:
        write_record_list(w, self.records)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, read_record_list(r))


@dataclass(frozen=True, slots=True)
class DamagedRecordsRequest(StorageMessage):
    """Which stored records of the partition failed verification here and are not repaired yet (ours)."""

    TYPE: ClassVar[int] = 22

    max_ids: int

    def _write(self, w: Writer) -> None:
        w.i32(self.max_ids)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i32())


@dataclass(frozen=True, slots=True)
class DamagedRecordsResponse(StorageMessage):
    """The damaged transaction ids, lowest first (ours)."""

    TYPE: ClassVar[int] = 23

    transaction_ids: Sequence[int]

    def _write(self, w: Writer) -> None:
        w.i32(len(self.transaction_ids))
        for txn in self.transaction_ids:
            w.i64(txn)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        n = r.count(8)
        return cls(session_id, seq_num, partition_id, tuple(r.i64() for _ in range(n)))


@dataclass(frozen=True, slots=True)
class TrimRequest(StorageMessage):
    """Raise the replica's trim point (ours; see the module docstring); answered by TrimResponse."""

    TYPE: ClassVar[int] = 24

    trim_point: int
    offline: bool = False

    def _write(self, w: Writer) -> None:
        w.i64(self.trim_point).bool(self.offline)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i64(), r.bool())


@dataclass(frozen=True, slots=True)
class TrimResponse(StorageMessage):
    """The trim point in force on the replica after a TrimRequest (ours)."""

    TYPE: ClassVar[int] = 25

    trim_point: int

    def _write(self, w: Writer) -> None:
        w.i64(self.trim_point)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i64())


MAX_SEGMENT_SIZES: Final = 65536
"""The most segments one SegmentSizesResponse lists (1 MiB of payload)."""


@dataclass(frozen=True, slots=True)
class SegmentSizesRequest(StorageMessage):
    """The replica's newest ``max_segments`` segments and their sizes (ours, V1; session-checked)."""

    TYPE: ClassVar[int] = 26
    MIN_VERSION: ClassVar[int] = 1
    max_segments: int

    def _write(self, w: Writer) -> None:
        w.i32(self.max_segments)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        return cls(session_id, seq_num, partition_id, r.i32())


@dataclass(frozen=True, slots=True)
class SegmentSizesResponse(StorageMessage):
    """``(first transaction id, bytes of data and index files)`` per segment, oldest first (ours, V1)."""

    TYPE: ClassVar[int] = 27
    MIN_VERSION: ClassVar[int] = 1
    segments: Sequence[tuple[int, int]]

    def _write(self, w: Writer) -> None:
        if len(self.segments) > MAX_SEGMENT_SIZES:
            raise LocalProtocolError(f"{len(self.segments)} segment sizes, at most {MAX_SEGMENT_SIZES}")
        w.i32(len(self.segments))
        for first, size in self.segments:
            w.i64(first).i64(size)

    @classmethod
    def _read(cls, r: Reader, session_id: int, seq_num: int, partition_id: int) -> Self:
        n = r.count(16)
        if n > MAX_SEGMENT_SIZES:
            raise RemoteProtocolError(f"{n} segment sizes, at most {MAX_SEGMENT_SIZES}")
        return cls(session_id, seq_num, partition_id, tuple((r.i64(), r.i64()) for _ in range(n)))


_BY_TYPE: Final[dict[int, type[StorageMessage]]] = {
    cls.TYPE: cls
    for cls in (
        OpenRequest,
        LastSessionInfoRequest,
        LastSessionInfoResponse,
        SetLowWaterMarkRequest,
        TruncateRequest,
        AppendRequest,
        SuccessResponse,
        FailureResponse,
        RecordHeaderRequest,
        RecordHeaderResponse,
        RecordRequest,
        RecordResponse,
        MaxTransactionIdRequest,
        MaxTransactionIdResponse,
        RecordHeaderListRequest,
        RecordHeaderListResponse,
        RecordListRequest,
        RecordListResponse,
        RecordRunRequest,
        RecordRunResponse,
        RepairRequest,
        DamagedRecordsRequest,
        DamagedRecordsResponse,
        TrimRequest,
        TrimResponse,
        SegmentSizesRequest,
        SegmentSizesResponse,
    )
}


def available(cls: type[StorageMessage], version: int) -> bool:
    """Whether codec ``version`` (a connection's negotiated one) has message ``cls``."""
    return version >= cls.MIN_VERSION


def encode(msg: StorageMessage) -> bytes:
    """The payload (without frame) of ``msg``; raises LocalProtocolError if a field does not fit."""
    cls = type(msg)
    if _BY_TYPE.get(cls.TYPE) is not cls:
        raise LocalProtocolError(f"not a storage message: {cls.__name__}")
    if cls is RecordRunResponse:
        assert isinstance(msg, RecordRunResponse)
        return encode_record_run_response(msg.session_id, msg.seq_num, msg.partition_id, msg.count, msg.run)
    if cls is RecordListResponse:
        assert isinstance(msg, RecordListResponse)
        records = msg.records
        if isinstance(records, WireRecordList) and records:
            # Already in wire form (a storage node's list read): one copy into the payload, as for a run.
            try:
                head = PREFIX.pack(cls.TYPE, msg.session_id, msg.seq_num, msg.partition_id)
            except struct.error:
                raise LocalProtocolError(f"storage message prefix out of range: {msg!r}") from None
            starts = records.starts
            body = memoryview(records.buffer)[starts[0] : starts[-1]]
            return b"".join((head, I32.pack(len(records)), body))
    w = Writer()
    try:
        w.buf += PREFIX.pack(cls.TYPE, msg.session_id, msg.seq_num, msg.partition_id)
    except struct.error:
        raise LocalProtocolError(f"storage message prefix out of range: {msg!r}") from None
    msg._write(w)
    return bytes(w.buf)


def append_request_body(records: Sequence[Record], offline: bool = False) -> bytes:
    """The bytes of ``AppendRequest(..., records, offline)`` after its prefix: the same for every replica a
    batch goes to, so a server encodes them once per batch (see :func:`encode_append_request`)."""
    w = Writer()
    write_record_list(w, records)
    w.buf.append(1 if offline else 0)  # (w.bool(offline), without the call)
    return bytes(w.buf)


def encode_append_request(session_id: int, seq_num: int, partition_id: int, body: bytes) -> bytes:
    """The payload of an AppendRequest whose fields after the prefix are ``body``
    (:func:`append_request_body`): the same bytes as :func:`encode` of the message."""
    try:
        return PREFIX.pack(AppendRequest.TYPE, session_id, seq_num, partition_id) + body
    except struct.error:
        raise LocalProtocolError(
            f"storage message prefix out of range: {(session_id, seq_num, partition_id)}"
        ) from None


def encode_record_run_response(
    session_id: int, seq_num: int, partition_id: int, count: int, run: bytes | bytearray | memoryview
) -> bytes:
    """``encode(RecordRunResponse(...))`` with the run copied once (a Writer copied it twice: into its buffer,
    then out as bytes; a run is up to 8 MiB, and a fresh buffer that size costs page faults as well)."""
    return b"".join(record_run_response_parts(session_id, seq_num, partition_id, count, run))


def record_run_response_parts(
    session_id: int, seq_num: int, partition_id: int, count: int, run: bytes | bytearray | memoryview
) -> tuple[bytes, bytes | bytearray | memoryview]:
    """``encode(RecordRunResponse(...))`` as ``(head, run)``, the run not copied: a storage node writes the
    two after each other (``FramedConnection.send(head, body)``)."""
    if len(run) > I32_MAX:
        raise LocalProtocolError(f"byte array too long: {len(run)}")
    try:
        head = _RUN_RESPONSE_HEAD.pack(
            RecordRunResponse.TYPE, session_id, seq_num, partition_id, count, len(run)
        )
    except struct.error:
        raise LocalProtocolError(
            f"record run response fields out of range: {(session_id, seq_num)}"
        ) from None
    return head, run


def encode_success(session_id: int, seq_num: int, partition_id: int) -> bytes:
    """``encode(SuccessResponse(session_id, seq_num, partition_id))`` without building the message (the
    storage node sends one per append)."""
    try:
        return PREFIX.pack(SuccessResponse.TYPE, session_id, seq_num, partition_id)
    except struct.error:
        raise LocalProtocolError("storage message prefix out of range") from None


_PREFIX_BYTES: Final = PREFIX.size
_SUCCESS: Final = SuccessResponse.TYPE
_new = object.__new__
_setattr = object.__setattr__


def decode(payload: bytes | bytearray | memoryview, version: int = STORAGE_VERSIONS[-1]) -> StorageMessage:
    """Decode one whole payload of codec ``version``; raises RemoteProtocolError if it is not exactly one
    valid message of that version."""
    data = payload if isinstance(payload, bytes) else bytes(payload)
    if (size := len(data)) < _PREFIX_BYTES:
        raise RemoteProtocolError(f"storage message truncated: {size} bytes, the prefix alone is 21")
    type_code, session_id, seq_num, partition_id = PREFIX.unpack_from(data, 0)
    if type_code == _SUCCESS and size == _PREFIX_BYTES:
        # Every append's answer (in every codec version): no Reader, and no generated __init__ call (a frozen
        # dataclass's sets its fields with object.__setattr__ anyway).
        ok = _new(SuccessResponse)
        _setattr(ok, "session_id", session_id)
        _setattr(ok, "seq_num", seq_num)
        _setattr(ok, "partition_id", partition_id)
        return ok
    cls = _BY_TYPE.get(type_code)
    if cls is None:
        raise RemoteProtocolError(f"unknown storage message type {type_code}")
    if version < cls.MIN_VERSION:
        raise RemoteProtocolError(f"storage message type {type_code} is not in codec V{version}")
    r = Reader(data, PREFIX.size)
    msg = cls._read(r, session_id, seq_num, partition_id)
    r.expect_end()
    return msg


seq_num_of: Callable[[StorageMessage], int] = operator.attrgetter("seq_num")
"""``seq_num_of(msg)``: the sequence number requests and responses are matched by (for
:class:`waltz.transport.RpcClient`). An attrgetter, not a function: a server asks it of every response."""


def failure_from_error(
    session_id: int, seq_num: int, partition_id: int, exc: BaseException
) -> FailureResponse:
    """A FailureResponse carrying ``exc`` (see :func:`rpc_failure_of`)."""
    return FailureResponse(session_id, seq_num, partition_id, rpc_failure_of(exc))


def failure_to_error(msg: FailureResponse | StorageRpcFailure) -> WaltzError:
    """The Waltz error a failure stands for; unknown class names become StorageRpcError."""
    failure = msg.failure if isinstance(msg, FailureResponse) else msg
    return error_from_wire(failure.class_name, failure.message)
