"""Storage admin messages (frame magic 'A', codec versions V0-V1), sans-I/O.

The admin port of a storage node is used by the CLI and by offline recovery. There is no session fencing.
Every payload starts with ``u8 type · i64 seq_num``; replies echo the request's ``seq_num``. Big-endian,
primitives as in :mod:`waltz.protocol.wire`:

====  ===============================  ===================================================================
code  message                          fields after the prefix
====  ===============================  ===================================================================
1     AdminSuccessResponse             -
2     AdminFailureResponse             StorageRpcException (see :mod:`waltz.protocol.storage`)
3     AdminOpenRequest                 uuid cluster_key · i32 num_partitions  (seq_num -1 by convention)
4     PartitionAvailableRequest        int list partition_ids · bool available
6     PartitionAssignmentRequest       int list partition_ids · bool assigned · bool delete_storage_files
7     RecordListRequest                i32 partition_id · i64 transaction_id · i32 max_records
8     RecordListResponse               i32 partition_id · i32 n · n x Record
9     LastSessionInfoRequest           i32 partition_id
10    LastSessionInfoResponse          i32 partition_id · i64 session_id · i64 low_water_mark
                                       · i64 local_low_water_mark · [u8 replica_flags]  (trailer ours)
11    MetricsRequest                   -
12    MetricsResponse                  string metrics_json
13    AssignedPartitionStatusRequest   -
14    AssignedPartitionStatusResponse  i32 n · n x (i32 partition_id · bool assigned and available)
15    MaxTransactionIdRequest          i32 partition_id                      (our addition, see below)
16    MaxTransactionIdResponse         i32 partition_id · i64 transaction_id (our addition)
17    NodeIdentityRequest              -                                     (our addition, see below)
18    NodeIdentityResponse             uuid cluster_key · i32 num_partitions · i32 data_port (our addition)
19    NodeVersionRequest               -                                     (V1, see below)
20    NodeVersionResponse              string software · i32 features_lo · i32 features_hi  (V1)
====  ===============================  ===================================================================

Versions: V0 is every message of Waltz 0.1.0 (1-18). V1 (Waltz 0.2.0) adds 19/20. A message exists from its
version on (``MIN_VERSION``): a sender never sends one the connection's negotiated version lacks (the caller
checks :func:`available` once, before it builds the request), and :func:`decode` given the negotiated version
refuses one as a protocol error. 19/20 tell the release (``software``, e.g. ``"0.2.0"``) and the range of
cluster feature versions the node supports (:mod:`waltz.cluster.features`), answered before the open, like
17/18; a node that negotiates V0 is Waltz 0.1.0, which supports feature version 1 only.

Code 5 is unused (the original design's separate read/write requests became the availability request).
``int list`` is ``i32 n · n x i32``; a null list (n = -1) is refused. Codes 15/16 are not in the original Java
Waltz: its ``max-transaction-id`` tool opened a data connection instead; we answer it on the admin port so the
CLI needs no store session. Codes 17/18 are ours too: the node's control-file identity (the cluster key and
partition count it was made for) and its data port, answered *before* the connection is opened (every other
request needs the open), so ``waltz cluster rebuild-metadata`` can learn the key from the nodes when
ZooKeeper's copy is lost. ``uuid`` is two i64, most significant first. Replies are AdminSuccess or
AdminFailure unless a response type is listed. The ``replica_flags`` trailer of 10 is the data port's
LastSessionInfoResponse trailer (see :mod:`waltz.protocol.storage`), sent only when the replica is damaged
(bit 0), so the operator tools can refuse a damaged replica as a copy source.

Decoders return a whole message or raise :class:`~waltz.errors.RemoteProtocolError`; encoders raise
:class:`~waltz.errors.LocalProtocolError` for values a field cannot carry. Sequences decode as tuples.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, NamedTuple, Self

from waltz.errors import LocalProtocolError, RemoteProtocolError, WaltzError, error_from_wire
from waltz.protocol.records import Record
from waltz.protocol.storage import (
    SessionInfo,
    StorageRpcFailure,
    read_failure,
    read_record_list,
    read_session_info,
    rpc_failure_of,
    write_failure,
    write_record_list,
    write_session_info,
)
from waltz.protocol.wire import I32, Reader, Writer

__all__ = [
    "ADMIN_CLIENT_HELLO",
    "ADMIN_SERVER_HELLO",
    "ADMIN_VERSIONS",
    "AdminFailureResponse",
    "AdminMessage",
    "AdminOpenRequest",
    "AdminSuccessResponse",
    "AssignedPartitionStatusRequest",
    "AssignedPartitionStatusResponse",
    "LastSessionInfoRequest",
    "LastSessionInfoResponse",
    "MaxTransactionIdRequest",
    "MaxTransactionIdResponse",
    "MetricsRequest",
    "MetricsResponse",
    "NodeIdentityRequest",
    "NodeIdentityResponse",
    "NodeVersionRequest",
    "NodeVersionResponse",
    "PartitionAssignmentRequest",
    "PartitionAvailableRequest",
    "PartitionStatus",
    "RecordListRequest",
    "RecordListResponse",
    "available",
    "decode",
    "encode",
    "failure_from_error",
    "failure_to_error",
    "seq_num_of",
]

ADMIN_VERSIONS: Final = (0, 1)
"""Codec versions of the storage admin protocol this implementation speaks (frame magic 'A')."""
ADMIN_CLIENT_HELLO: Final = "Waltz Storage Admin Client"
ADMIN_SERVER_HELLO: Final = "Waltz Storage Admin Server"

PREFIX: Final = struct.Struct(">Bq")
_STATUS: Final = struct.Struct(">i?")


class PartitionStatus(NamedTuple):
    """One entry of AssignedPartitionStatusResponse: ``available`` means assigned and available."""

    partition_id: int
    available: bool


def _read_partition_ids(r: Reader) -> tuple[int, ...]:
    # Reader.int_list checks the count against the remaining bytes before allocating.
    ids = r.int_list()
    if ids is None:
        raise RemoteProtocolError("partition id list is null")
    return tuple(ids)


@dataclass(frozen=True, slots=True)
class AdminMessage:
    """Base of every admin message: the common prefix. ``TYPE`` is the wire type code."""

    TYPE: ClassVar[int] = 0
    MIN_VERSION: ClassVar[int] = 0
    """The first codec version that has this message."""

    seq_num: int

    def _write(self, w: Writer) -> None:
        """Append the fields after the prefix (none for the base)."""

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num)


@dataclass(frozen=True, slots=True)
class AdminSuccessResponse(AdminMessage):
    TYPE: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class AdminFailureResponse(AdminMessage):
    """The request failed; :func:`failure_to_error` turns it back into a Waltz error."""

    TYPE: ClassVar[int] = 2

    failure: StorageRpcFailure

    def _write(self, w: Writer) -> None:
        write_failure(w, self.failure)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, read_failure(r))


@dataclass(frozen=True, slots=True)
class AdminOpenRequest(AdminMessage):
    """First request on an admin connection: the node checks the cluster key and partition count."""

    TYPE: ClassVar[int] = 3

    cluster_key: uuid.UUID
    num_partitions: int

    def _write(self, w: Writer) -> None:
        w.uuid(self.cluster_key).i32(self.num_partitions)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, r.uuid(), r.i32())


@dataclass(frozen=True, slots=True)
class PartitionAvailableRequest(AdminMessage):
    """Set or clear the AVAILABLE flag (online/offline for reads and writes) of the listed partitions."""

    TYPE: ClassVar[int] = 4

    partition_ids: Sequence[int]
    available: bool

    def _write(self, w: Writer) -> None:
        w.int_list(self.partition_ids).bool(self.available)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, _read_partition_ids(r), r.bool())


@dataclass(frozen=True, slots=True)
class PartitionAssignmentRequest(AdminMessage):
    """Assign (create and open) or unassign (reset, close, optionally delete files) the listed partitions."""

    TYPE: ClassVar[int] = 6

    partition_ids: Sequence[int]
    assigned: bool
    delete_storage_files: bool

    def _write(self, w: Writer) -> None:
        w.int_list(self.partition_ids).bool(self.assigned).bool(self.delete_storage_files)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, _read_partition_ids(r), r.bool(), r.bool())


@dataclass(frozen=True, slots=True)
class RecordListRequest(AdminMessage):
    """Unfenced bulk read of consecutive records (offline recovery)."""

    TYPE: ClassVar[int] = 7

    partition_id: int
    transaction_id: int
    max_records: int

    def _write(self, w: Writer) -> None:
        w.i32(self.partition_id).i64(self.transaction_id).i32(self.max_records)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, r.i32(), r.i64(), r.i32())


@dataclass(frozen=True, slots=True)
class RecordListResponse(AdminMessage):
    TYPE: ClassVar[int] = 8

    partition_id: int
    records: Sequence[Record]

    def _write(self, w: Writer) -> None:
        w.i32(self.partition_id)
        write_record_list(w, self.records)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, r.i32(), read_record_list(r))


@dataclass(frozen=True, slots=True)
class LastSessionInfoRequest(AdminMessage):
    TYPE: ClassVar[int] = 9

    partition_id: int

    def _write(self, w: Writer) -> None:
        w.i32(self.partition_id)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, r.i32())


@dataclass(frozen=True, slots=True)
class LastSessionInfoResponse(AdminMessage):
    TYPE: ClassVar[int] = 10

    partition_id: int
    info: SessionInfo

    def _write(self, w: Writer) -> None:
        write_session_info(w.i32(self.partition_id), self.info)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, r.i32(), read_session_info(r))


@dataclass(frozen=True, slots=True)
class MetricsRequest(AdminMessage):
    TYPE: ClassVar[int] = 11


@dataclass(frozen=True, slots=True)
class MetricsResponse(AdminMessage):
    """The node's metrics as a JSON document."""

    TYPE: ClassVar[int] = 12

    metrics_json: str

    def _write(self, w: Writer) -> None:
        w.string(self.metrics_json)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, r.string_required())


@dataclass(frozen=True, slots=True)
class AssignedPartitionStatusRequest(AdminMessage):
    TYPE: ClassVar[int] = 13


@dataclass(frozen=True, slots=True)
class AssignedPartitionStatusResponse(AdminMessage):
    """Every assigned partition with whether it is also available."""

    TYPE: ClassVar[int] = 14

    statuses: Sequence[PartitionStatus]

    def _write(self, w: Writer) -> None:
        if len(self.statuses) > 0x7FFFFFFF:
            raise LocalProtocolError(f"too many partition statuses: {len(self.statuses)}")
        w.buf += I32.pack(len(self.statuses))
        try:
            for partition_id, available in self.statuses:
                w.buf += _STATUS.pack(partition_id, bool(available))
        except (struct.error, TypeError, ValueError) as e:
            raise LocalProtocolError(f"partition status cannot be encoded: {e}") from None

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        n = r.count(_STATUS.size)
        statuses = tuple(PartitionStatus(r.i32(), r.bool()) for _ in range(n))
        return cls(seq_num, statuses)


@dataclass(frozen=True, slots=True)
class MaxTransactionIdRequest(AdminMessage):
    """Our addition (code 15): the partition's highest stored transaction id, read without a session."""

    TYPE: ClassVar[int] = 15

    partition_id: int

    def _write(self, w: Writer) -> None:
        w.i32(self.partition_id)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, r.i32())


@dataclass(frozen=True, slots=True)
class MaxTransactionIdResponse(AdminMessage):
    """Our addition (code 16): ``transaction_id`` is -1 for an empty partition."""

    TYPE: ClassVar[int] = 16

    partition_id: int
    transaction_id: int

    def _write(self, w: Writer) -> None:
        w.i32(self.partition_id).i64(self.transaction_id)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, r.i32(), r.i64())


@dataclass(frozen=True, slots=True)
class NodeIdentityRequest(AdminMessage):
    """Our addition (code 17): what cluster this node was made for. Answered before the open."""

    TYPE: ClassVar[int] = 17


@dataclass(frozen=True, slots=True)
class NodeIdentityResponse(AdminMessage):
    """Our addition (code 18): the control file's cluster key and partition count, and the data port."""

    TYPE: ClassVar[int] = 18

    cluster_key: uuid.UUID
    num_partitions: int
    data_port: int

    def _write(self, w: Writer) -> None:
        w.uuid(self.cluster_key).i32(self.num_partitions).i32(self.data_port)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        return cls(seq_num, r.uuid(), r.i32(), r.i32())


@dataclass(frozen=True, slots=True)
class NodeVersionRequest(AdminMessage):
    """V1 (code 19): the node's release and supported feature versions. Answered before the open."""

    TYPE: ClassVar[int] = 19
    MIN_VERSION: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class NodeVersionResponse(AdminMessage):
    """V1 (code 20): the node's release and the cluster feature versions it supports, lo to hi."""

    TYPE: ClassVar[int] = 20
    MIN_VERSION: ClassVar[int] = 1

    software: str
    features_lo: int
    features_hi: int

    def _write(self, w: Writer) -> None:
        w.string(self.software).i32(self.features_lo).i32(self.features_hi)

    @classmethod
    def _read(cls, r: Reader, seq_num: int) -> Self:
        software = r.string_required()
        return cls(seq_num, software, r.i32(), r.i32())


_BY_TYPE: Final[dict[int, type[AdminMessage]]] = {
    cls.TYPE: cls
    for cls in (
        AdminSuccessResponse,
        AdminFailureResponse,
        AdminOpenRequest,
        PartitionAvailableRequest,
        PartitionAssignmentRequest,
        RecordListRequest,
        RecordListResponse,
        LastSessionInfoRequest,
        LastSessionInfoResponse,
        MetricsRequest,
        MetricsResponse,
        AssignedPartitionStatusRequest,
        AssignedPartitionStatusResponse,
        MaxTransactionIdRequest,
        MaxTransactionIdResponse,
        NodeIdentityRequest,
        NodeIdentityResponse,
        NodeVersionRequest,
        NodeVersionResponse,
    )
}


def available(cls: type[AdminMessage], version: int) -> bool:
    """Whether codec ``version`` (a connection's negotiated one) has message ``cls``."""
    return version >= cls.MIN_VERSION


def encode(msg: AdminMessage) -> bytes:
    """The payload (without frame) of ``msg``; raises LocalProtocolError if a field does not fit."""
    cls = type(msg)
    if _BY_TYPE.get(cls.TYPE) is not cls:
        raise LocalProtocolError(f"not an admin message: {cls.__name__}")
    w = Writer()
    try:
        w.buf += PREFIX.pack(cls.TYPE, msg.seq_num)
    except struct.error:
        raise LocalProtocolError(f"admin message prefix out of range: {msg!r}") from None
    msg._write(w)
    return bytes(w.buf)


def decode(payload: bytes | bytearray | memoryview, version: int = ADMIN_VERSIONS[-1]) -> AdminMessage:
    """Decode one whole payload of codec ``version``; raises RemoteProtocolError if it is not exactly one
    valid message of that version."""
    data = payload if isinstance(payload, bytes) else bytes(payload)
    if len(data) < PREFIX.size:
        raise RemoteProtocolError(f"admin message truncated: {len(data)} bytes, the prefix alone is 9")
    type_code, seq_num = PREFIX.unpack_from(data, 0)
    cls = _BY_TYPE.get(type_code)
    if cls is None:
        raise RemoteProtocolError(f"unknown admin message type {type_code}")
    if version < cls.MIN_VERSION:
        raise RemoteProtocolError(
            f"admin message type {type_code} ({cls.__name__}) is not in codec V{version}"
            f" (it is V{cls.MIN_VERSION}+)"
        )
    r = Reader(data, PREFIX.size)
    msg = cls._read(r, seq_num)
    r.expect_end()
    return msg


def seq_num_of(msg: AdminMessage) -> int:
    """The sequence number requests and responses are matched by (for :class:`waltz.transport.RpcClient`)."""
    return msg.seq_num


def failure_from_error(seq_num: int, exc: BaseException) -> AdminFailureResponse:
    """An AdminFailureResponse carrying ``exc`` (first frame names its Waltz error class)."""
    return AdminFailureResponse(seq_num, rpc_failure_of(exc))


def failure_to_error(msg: AdminFailureResponse | StorageRpcFailure) -> WaltzError:
    """The Waltz error a failure stands for; unknown class names become StorageRpcError."""
    failure = msg.failure if isinstance(msg, AdminFailureResponse) else msg
    return error_from_wire(failure.class_name, failure.message)
