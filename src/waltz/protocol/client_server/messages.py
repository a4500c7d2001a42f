"""The messages of a mounted partition besides appends and the feed: mount, transaction data and ranges,
flush, lock failure and high-water mark (the format is in :mod:`waltz.protocol.client_server`)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, Self

from waltz.errors import LocalProtocolError, RemoteProtocolError, TrimmedError
from waltz.protocol.client_server.base import (
    _I64,
    _INT,
    _PREFIX_BYTES,
    MessageType,
    PartitionState,
    _check_high_water_mark,
    _Message,
    _prefix,
    _read_req_id,
)
from waltz.protocol.record_run import STORED_OVERHEAD_BYTES, RunBytes, encode_run, run_records
from waltz.protocol.records import Record, ReqId, crc32
from waltz.protocol.wire import Reader, Writer

# Module constants, not imported: CPython compiles ``name.method(...)`` of an imported name without
# LOAD_METHOD (it takes the name for a module), which builds a bound method on every call of the hot path.
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")

_RANGE_HEAD = struct.Struct(">qii")  # transactionId, n, run length


@dataclass(frozen=True, slots=True)
class MountRequest(_Message):
    """Mount a partition: stream every transaction after ``client_high_water_mark``, then answer READY.

    ``seq_num`` is the incarnation number of the client's network connection; the server ignores older ones.
    """

    TYPE: ClassVar[MessageType] = MessageType.MOUNT_REQUEST
    _KINDS: ClassVar[tuple[str, ...] | None] = (_I64, _I64)

    req_id: ReqId
    client_high_water_mark: int
    seq_num: int

    def _check(self, error: type[LocalProtocolError | RemoteProtocolError]) -> None:
        _check_high_water_mark(self, self.client_high_water_mark, error)


@dataclass(frozen=True, slots=True)
class MountResponse(_Message):
    """The server's answer to a mount. Under V0-V2 only READY / not READY survives the wire."""

    TYPE: ClassVar[MessageType] = MessageType.MOUNT_RESPONSE
    _KINDS: ClassVar[tuple[str, ...] | None] = None

    req_id: ReqId
    state: PartitionState

    @property
    def partition_ready(self) -> bool:
        return self.state == PartitionState.READY

    def _encode(self, version: int) -> bytes:
        head = _prefix(self.TYPE, self.req_id)
        if version >= 3:
            try:
                return head + _I32.pack(PartitionState(self.state).value)
            except ValueError:
                raise LocalProtocolError(f"unknown partition state {self.state}") from None
        # Older codecs have only a boolean: CLIENT_AHEAD travels as "not ready", as the original does.
        return head + (b"\x01" if self.state == PartitionState.READY else b"\x00")

    @classmethod
    def _decode(cls, payload: bytes | bytearray | memoryview, version: int) -> MountResponse:
        r = Reader(payload, _PREFIX_BYTES)
        req_id = _read_req_id(payload)
        if version >= 3:
            code = r.i32()
            try:
                state = PartitionState(code)
            except ValueError:
                raise RemoteProtocolError(f"unknown partition state {code}") from None
        else:
            state = PartitionState.READY if r.bool() else PartitionState.NOT_READY
        r.expect_end()
        return cls(req_id, state)


@dataclass(frozen=True, slots=True)
class TransactionDataRequest(_Message):
    """Fetch the data of one committed transaction (RPC connection)."""

    TYPE: ClassVar[MessageType] = MessageType.TRANSACTION_DATA_REQUEST
    _KINDS: ClassVar[tuple[str, ...] | None] = (_I64,)

    req_id: ReqId
    transaction_id: int


@dataclass(frozen=True, slots=True)
class TransactionDataResponse(_Message):
    """The data of a transaction (``data`` and ``checksum``), or why it could not be read (``error``).

    Exactly one of ``data`` and ``error`` is meaningful: the response is ``ok`` when ``data`` is not None. Use
    :meth:`success` and :meth:`failure` to build one.
    """

    TYPE: ClassVar[MessageType] = MessageType.TRANSACTION_DATA_RESPONSE
    _KINDS: ClassVar[tuple[str, ...] | None] = None

    req_id: ReqId
    transaction_id: int
    data: bytes | None
    checksum: int
    error: str | None

    @classmethod
    def success(
        cls, req_id: ReqId, transaction_id: int, data: bytes, checksum: int | None = None
    ) -> TransactionDataResponse:
        return cls(req_id, transaction_id, data, crc32(data) if checksum is None else checksum, None)

    @classmethod
    def failure(cls, req_id: ReqId, transaction_id: int, error: str | None) -> TransactionDataResponse:
        return cls(req_id, transaction_id, None, 0, error)

    @property
    def ok(self) -> bool:
        return self.data is not None

    def _encode(self, version: int) -> bytes:
        w = Writer()
        w.buf += _prefix(self.TYPE, self.req_id)
        w.i64(self.transaction_id)
        if self.data is not None:
            if self.error is not None:
                raise LocalProtocolError("a TransactionDataResponse carries data or an error, not both")
            w.bool(True).bytes_(self.data)
            try:
                w.buf += _U32.pack(self.checksum)
            except struct.error:
                raise LocalProtocolError(f"checksum is not an unsigned 32-bit int: {self.checksum}") from None
        else:
            w.bool(False).string(self.error)
        return w.getvalue()

    @classmethod
    def _decode(cls, payload: bytes | bytearray | memoryview, version: int) -> TransactionDataResponse:
        req_id = _read_req_id(payload)
        r = Reader(payload, _PREFIX_BYTES)
        txn = r.i64()
        if r.bool():
            data = r.bytes_required()
            checksum = r.u32()
            r.expect_end()
            if crc32(data) != checksum:
                raise RemoteProtocolError(
                    f"transaction {txn} data checksum mismatch: carried {checksum:#010x}, "
                    f"computed {crc32(data):#010x}"
                )
            return cls(req_id, txn, data, checksum, None)
        error = r.string()
        r.expect_end()
        return cls(req_id, txn, None, 0, error)


@dataclass(frozen=True, slots=True)
class FlushRequest(_Message):
    """Answer once every append sent before this request is resolved."""

    TYPE: ClassVar[MessageType] = MessageType.FLUSH_REQUEST

    req_id: ReqId


@dataclass(frozen=True, slots=True)
class FlushResponse(_Message):
    """The partition high-water mark once the appends sent before the flush were resolved."""

    TYPE: ClassVar[MessageType] = MessageType.FLUSH_RESPONSE
    _KINDS: ClassVar[tuple[str, ...] | None] = (_I64,)

    req_id: ReqId
    transaction_id: int


@dataclass(frozen=True, slots=True)
class LockFailure(_Message):
    """The append of ``req_id`` was rejected; ``transaction_id`` is the conflicting lock high-water mark."""

    TYPE: ClassVar[MessageType] = MessageType.LOCK_FAILURE
    _KINDS: ClassVar[tuple[str, ...] | None] = (_I64,)

    req_id: ReqId
    transaction_id: int


@dataclass(frozen=True, slots=True)
class HighWaterMarkRequest(_Message):
    """Ask for the partition's last committed transaction id."""

    TYPE: ClassVar[MessageType] = MessageType.HIGH_WATER_MARK_REQUEST

    req_id: ReqId


HWM_NOT_SERVED = -2
"""``HighWaterMarkResponse.transaction_id`` of a partition the server owns but cannot serve: its store session
is not open (it has not opened since the server took the partition, or it ended and no new one opened: too
few clean replicas reachable), so the log's high-water mark is unknown (the last one the server knew may have
been passed, or cannot be read now). Readers raise a retriable PartitionNotReadyError; they must never read it
as an empty log."""


@dataclass(frozen=True, slots=True)
class HighWaterMarkResponse(_Message):
    """The partition's last committed transaction id (-1 for an empty log, :data:`HWM_NOT_SERVED` (-2) when
    the owning server does not serve the partition)."""

    TYPE: ClassVar[MessageType] = MessageType.HIGH_WATER_MARK_RESPONSE
    _KINDS: ClassVar[tuple[str, ...] | None] = (_I64,)

    req_id: ReqId
    transaction_id: int


@dataclass(frozen=True, slots=True)
class TransactionRangeRequest(_Message):
    """Read up to ``max_count`` committed transactions from ``transaction_id``, data included (V5, ours)."""

    TYPE: ClassVar[MessageType] = MessageType.TRANSACTION_RANGE_REQUEST
    MIN_VERSION: ClassVar[int] = 5
    _KINDS: ClassVar[tuple[str, ...] | None] = (_I64, _INT)

    req_id: ReqId
    transaction_id: int
    max_count: int


@dataclass(frozen=True, slots=True)
class TransactionRangeResponse(_Message):
    """``count`` consecutive committed records from ``transaction_id`` as a record run (none at or past the
    high-water mark) (V5). The decoder checks the framing only; :meth:`records` (or any run unpacker) checks
    the run's shape and verifies the checksums."""

    TYPE: ClassVar[MessageType] = MessageType.TRANSACTION_RANGE_RESPONSE
    MIN_VERSION: ClassVar[int] = 5
    _KINDS: ClassVar[tuple[str, ...] | None] = None

    req_id: ReqId
    transaction_id: int
    count: int
    run: RunBytes
    """A view of the received payload when decoded (see :data:`~waltz.protocol.record_run.RunBytes`)."""

    @classmethod
    def of(cls, req_id: ReqId, transaction_id: int, records: tuple[Record, ...] | list[Record]) -> Self:
        """The response carrying ``records`` (tests, and servers holding decoded records)."""
        return cls(req_id, transaction_id, len(records), encode_run(records))

    def records(self) -> list[Record]:
        """The records, every checksum verified (raises DataChecksumError otherwise)."""
        return run_records(self.run, self.transaction_id, self.count)

    def _encode(self, version: int) -> bytes:
        return self._head() + self.run

    def _head(self) -> bytes:
        try:
            return _prefix(self.TYPE, self.req_id) + _RANGE_HEAD.pack(
                self.transaction_id, self.count, len(self.run)
            )
        except struct.error:
            raise LocalProtocolError(
                f"range response field out of range: {self.transaction_id}, {self.count}"
            ) from None

    @classmethod
    def _decode(cls, payload: bytes | bytearray | memoryview, version: int) -> TransactionRangeResponse:
        r = Reader(payload, _PREFIX_BYTES)
        req_id = _read_req_id(payload)
        transaction_id = r.i64()
        count = r.i32()
        run = r.bytes_view_required()  # the run's megabytes are not copied out of the payload
        r.expect_end()
        if count < 0 or count * STORED_OVERHEAD_BYTES > len(run):
            raise RemoteProtocolError(
                f"a range response's run of {len(run)} bytes cannot hold {count} records"
            )
        # The run's shape (ids, lengths) is not walked here: every consumer unpacks the run with run_bounds,
        # which checks the shape and both checksums of every record in the one pass it makes anyway. A walk
        # here cost a third as much again per record, on the reader's side of a bulk read.
        return cls(req_id, transaction_id, count, run)


@dataclass(frozen=True, slots=True)
class TrimmedResponse(_Message):
    """The answer to a TransactionRangeRequest or a MountRequest (same ReqId) that asks for transactions below
    the partition's trim point (V6, ours): ``transaction_id`` is the first id asked for (the range's start, or
    the mount's client high-water mark + 1), ``trim_point`` the lowest id still readable. Final for the
    request: the client raises :class:`~waltz.errors.TrimmedError`."""

    TYPE: ClassVar[MessageType] = MessageType.TRIMMED_RESPONSE
    MIN_VERSION: ClassVar[int] = 6
    _KINDS: ClassVar[tuple[str, ...] | None] = (_I64, _I64)

    req_id: ReqId
    transaction_id: int
    trim_point: int

    def _check(self, error: type[LocalProtocolError | RemoteProtocolError]) -> None:
        if not 0 <= self.transaction_id < self.trim_point:
            raise error(
                f"TrimmedResponse: transaction {self.transaction_id} is not below the trim point "
                f"{self.trim_point}"
            )

    def error(self) -> TrimmedError:
        """The error this answer reports, naming the partition, the requested id and the trim point."""
        return TrimmedError.below(self.req_id.partition_id, self.transaction_id, self.trim_point)
