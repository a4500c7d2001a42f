"""The client <-> server message codec (frame magic ``'L'``, codec versions V0..V5), with no I/O.

:func:`encode` turns a message into a frame *payload* (the framing layer adds ``magic · version · length``);
:func:`decode` turns one payload back into a message. The version is the one the hello handshake negotiated.

Every payload starts ``type:u8 · ReqId(16)``; the fields below follow in this order. Integers are
big-endian (``i32``/``i64`` two's complement, ``u32`` unsigned), ``bool`` is one byte 0/1, ``int[]`` is
``i32 n · n x i32`` (``n = -1``, Java's null array, is read as empty and never written), ``bytes`` is
``i32 n · n bytes`` and ``string`` is UTF-8 written as ``bytes`` (``n = -1`` is ``None``).
ReqId = ``u64 msb · u64 lsb`` (see :mod:`waltz.protocol.records`)::

    code message                             fields after the ReqId                                    codec
    ---- ----------------------------------- --------------------------------------------------------- -----
     0   MountRequest                        i64 clientHighWaterMark · i64 seqNum                      V0+
     1   MountResponse                       V0-V2: bool partitionReady                                V0+
                                             V3+:   i32 partitionState (0 READY, 1 NOT_READY,
                                                    2 CLIENT_AHEAD)
     2   AppendRequest                       i64 clientHighWaterMark · int[] writeLocks ·              V0+
                                             int[] readLocks (V1+) · int[] appendLocks (V2+) ·
                                             i32 header · bytes data · u32 checksum
     3   FeedRequest                         i64 clientHighWaterMark                                   V0+
     4   FeedData                            i64 transactionId · i32 header                            V0+
     5   FeedSuspended                       -                                                         V0+
     6   TransactionDataRequest              i64 transactionId                                         V0+
     7   TransactionDataResponse             i64 transactionId · bool ok ·                             V0+
                                             ok:  bytes data · u32 checksum
                                             not: string error
     8   FlushRequest                        -                                                         V0+
     9   FlushResponse                       i64 transactionId                                         V0+
    10   LockFailure                         i64 transactionId                                         V0+
    11   HighWaterMarkRequest                -                                                         V0+
    12   HighWaterMarkResponse               i64 transactionId (-2: not served, HWM_NOT_SERVED)        V0+
    13   CheckStorageConnectivityRequest     -                                                         V1+
    14   CheckStorageConnectivityResponse    i32 n · n x (string connectString · bool reachable)       V1+
    15   ServerPartitionsAssignmentRequest   -                                                         V2+
    16   ServerPartitionsAssignmentResponse  i32 n · n x i32 partitionId                               V2+
    17   AddPreferredPartitionRequest        i32 n · n x i32 partitionId                               V2+
    18   AddPreferredPartitionResponse       bool result                                               V2+
    19   RemovePreferredPartitionRequest     i32 n · n x i32 partitionId                               V2+
    20   RemovePreferredPartitionResponse    bool result                                               V2+
    21   ServerPartitionsHealthStatRequest   -                                                         V4
    22   ServerPartitionsHealthStatResponse  i32 n · n x (i32 partitionId · bool healthy)              V4
    23   TransactionRangeRequest             i64 transactionId · i32 maxCount                          V5
    24   TransactionRangeResponse            i64 transactionId · i32 n · bytes run (n records)         V5

Checksums: ``checksum`` is the CRC-32 (java.util.zip.CRC32) of ``data`` alone, computed by the client that
built the transaction. Decoding an AppendRequest or a successful TransactionDataResponse verifies it and
raises :class:`~waltz.errors.RemoteProtocolError` on a mismatch, so corrupted data never leaves the codec.
Encoding does not recompute it: the client computed it from the very bytes it sends, and the server relays the
checksum stored with the record so the client checks the data end to end.

Versions: V1 added read locks and 13/14; V2 append locks and 15-20; V3 the three-state MountResponse (older
codecs carry CLIENT_AHEAD as ``partitionReady = false``, which decodes as NOT_READY); V4 added 21/22.
V5 is ours, not the original's: 23/24 read a range of committed transactions (headers and data) in one round
trip, for bulk readers such as the Spark data source. The response holds consecutive committed records from
``transactionId`` (fewer than asked, or none, at the high-water mark) as a *record run*: the records exactly
as the storage node stores them, each with its data checksum and a record checksum
(:mod:`waltz.protocol.record_run`). The server relays the run without decoding it; the decoder checks only
that the run can hold its count, and the reader checks its shape (ids, lengths) and every checksum in one
pass when it unpacks it.

Guarantees (the h11 contract):

* :func:`decode` returns one whole message or raises :class:`~waltz.errors.RemoteProtocolError`, never
  anything else: on an unknown type, a type the negotiated version does not have, a short payload, trailing
  bytes, a bad boolean, a negative or oversized length, invalid UTF-8, an unknown partition state or a
  checksum mismatch. Every count is checked against the bytes that remain before anything is allocated, so
  list lengths are bounded by the payload (itself bounded by the framing layer's maximum frame size).
* :func:`encode` raises :class:`~waltz.errors.LocalProtocolError` for anything the negotiated version cannot
  carry: a message type newer than the version, read locks under V0 or append locks under V0/V1 ("not
  supported, upgrade servers"), an out-of-range integer, or inconsistent TransactionDataResponse fields.
* A version outside :data:`SUPPORTED_VERSIONS` is a bug of the caller (the handshake only picks supported
  ones) and raises LocalProtocolError on both sides.

AppendRequest and FeedData are the hot path (tens of thousands per second per server), so they are encoded
and decoded with precompiled structs and explicit bounds checks instead of the generic Reader/Writer walk the
other messages use.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Final, NamedTuple, Self, TypeAlias

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol.checksum import crc32 as _crc32
from waltz.protocol.framing import FRAME_HEADER, FRAME_HEADER_BYTES, MAGIC_CLIENT
from waltz.protocol.record_run import STORED_OVERHEAD_BYTES, RunBytes, encode_run, run_records
from waltz.protocol.records import Record, RecordHeader, ReqId, crc32
from waltz.protocol.wire import Reader, Writer

__all__ = [
    "FEED_WINDOW_MAX",
    "HWM_NOT_SERVED",
    "MAGIC",
    "SUPPORTED_VERSIONS",
    "AddPreferredPartitionRequest",
    "AddPreferredPartitionResponse",
    "AppendFields",
    "AppendMessage",
    "AppendRequest",
    "CheckStorageConnectivityRequest",
    "CheckStorageConnectivityResponse",
    "FeedData",
    "FeedEntry",
    "FeedRequest",
    "FeedSuspended",
    "FlushRequest",
    "FlushResponse",
    "HighWaterMarkRequest",
    "HighWaterMarkResponse",
    "LockFailure",
    "Message",
    "MessageType",
    "MountRequest",
    "MountResponse",
    "PartitionState",
    "RemovePreferredPartitionRequest",
    "RemovePreferredPartitionResponse",
    "ServerPartitionsAssignmentRequest",
    "ServerPartitionsAssignmentResponse",
    "ServerPartitionsHealthStatRequest",
    "ServerPartitionsHealthStatResponse",
    "TransactionDataRequest",
    "TransactionDataResponse",
    "TransactionRangeRequest",
    "TransactionRangeResponse",
    "decode",
    "decode_append_fields",
    "decode_feed_data",
    "decode_feed_run",
    "frame_append",
    "new_append_request",
    "encode",
    "encode_range_response_parts",
]

MAGIC = 0x4C
"""Frame magic byte of this codec (``'L'``)."""

SUPPORTED_VERSIONS: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
"""Codec versions this module speaks; the hello handshake picks the highest one both peers have."""

_MASK64 = 0xFFFFFFFFFFFFFFFF
_tuple_new = tuple.__new__
"""``_tuple_new(ReqId, (msb, lsb))`` builds a ReqId in C, without its generated ``__new__``."""

_PREFIX = struct.Struct(">BQQ")  # type, ReqId msb, ReqId lsb
_PREFIX_BYTES = _PREFIX.size  # 17
_APPEND_HEAD = struct.Struct(">BQQqi")  # type, ReqId, clientHighWaterMark, writeLocks count
_FEED_DATA = struct.Struct(">BQQqi")  # type, ReqId, transactionId, header
_APPEND_HEAD_NO_LOCKS = struct.Struct(">BQQqiiiii")  # V2+: type, ReqId, hwm, 0 locks x3, header, length
# V2+ with one write lock and no other (a conditional append on one key): type, ReqId, hwm, 1, the lock, no
# read and no append locks, header, length.
_APPEND_HEAD_ONE_WRITE = struct.Struct(">BQQqiiiiii")


@functools.lru_cache(maxsize=64)
def _append_head_v2(nw: int, nr: int, na: int) -> struct.Struct:
    """The V2+ AppendRequest head for these lock counts, compiled once (appends reuse a few shapes)."""
    return struct.Struct(f">BQQqi{nw}ii{nr}ii{na}iii")


_I32 = struct.Struct(">i")
_HEADER_AND_LENGTH = struct.Struct(">ii")
_U32 = struct.Struct(">I")


class MessageType(IntEnum):
    """The ``type`` byte that starts every payload."""

    MOUNT_REQUEST = 0
    MOUNT_RESPONSE = 1
    APPEND_REQUEST = 2
    FEED_REQUEST = 3
    FEED_DATA = 4
    FEED_SUSPENDED = 5
    TRANSACTION_DATA_REQUEST = 6
    TRANSACTION_DATA_RESPONSE = 7
    FLUSH_REQUEST = 8
    FLUSH_RESPONSE = 9
    LOCK_FAILURE = 10
    HIGH_WATER_MARK_REQUEST = 11
    HIGH_WATER_MARK_RESPONSE = 12
    CHECK_STORAGE_CONNECTIVITY_REQUEST = 13
    CHECK_STORAGE_CONNECTIVITY_RESPONSE = 14
    SERVER_PARTITIONS_ASSIGNMENT_REQUEST = 15
    SERVER_PARTITIONS_ASSIGNMENT_RESPONSE = 16
    ADD_PREFERRED_PARTITION_REQUEST = 17
    ADD_PREFERRED_PARTITION_RESPONSE = 18
    REMOVE_PREFERRED_PARTITION_REQUEST = 19
    REMOVE_PREFERRED_PARTITION_RESPONSE = 20
    SERVER_PARTITIONS_HEALTH_STAT_REQUEST = 21
    SERVER_PARTITIONS_HEALTH_STAT_RESPONSE = 22
    TRANSACTION_RANGE_REQUEST = 23
    TRANSACTION_RANGE_RESPONSE = 24


class PartitionState(IntEnum):
    """The answer to a mount (V3+ carries it as an int; V0-V2 only as ``partitionReady``)."""

    READY = 0
    NOT_READY = 1
    CLIENT_AHEAD = 2


# Field kinds of the generic (non hot path) messages. Each message class lists the kinds of the fields that
# follow its ReqId; the generic walker below writes and reads them in that order.

_I64 = "i64"
_BOOL = "bool"
_INTS = "ints"  # i32 n · n x i32
_STR_BOOLS = "str_bools"  # i32 n · n x (string · bool)
_INT_BOOLS = "int_bools"  # i32 n · n x (i32 · bool)
_INT = "int"  # i32
_RANGE_HEAD = struct.Struct(">qii")  # transactionId, n, run length


def _write_field(w: Writer, kind: str, value: object) -> None:
    if kind == _I64:
        w.i64(value)  # type: ignore[arg-type]
    elif kind == _BOOL:
        w.bool(value)  # type: ignore[arg-type]
    elif kind == _INTS:
        w.int_list(value)  # type: ignore[arg-type]
    elif kind == _STR_BOOLS:
        pairs: tuple[tuple[str, bool], ...] = value  # type: ignore[assignment]
        w.i32(len(pairs))
        for text, flag in pairs:
            if text is None:
                raise LocalProtocolError("a connect string may not be None")
            w.string(text).bool(flag)
    elif kind == _INT_BOOLS:
        int_pairs: tuple[tuple[int, bool], ...] = value  # type: ignore[assignment]
        w.i32(len(int_pairs))
        for number, flag in int_pairs:
            w.i32(number).bool(flag)
    elif kind == _INT:
        w.i32(value)  # type: ignore[arg-type]
    else:  # pragma: no cover - the kinds are module constants
        raise LocalProtocolError(f"unknown field kind {kind}")


def _read_field(r: Reader, kind: str) -> object:
    if kind == _I64:
        return r.i64()
    if kind == _BOOL:
        return r.bool()
    if kind == _INTS:
        n = r.count(4)  # bounded by the bytes that remain, so a forged count cannot allocate
        start = r._take(4 * n)
        return struct.unpack_from(f">{n}i", r.data, start)
    if kind == _STR_BOOLS:
        n = r.count(5)  # an empty string (4) and a bool (1) at least
        return tuple((r.string_required(), r.bool()) for _ in range(n))
    if kind == _INT_BOOLS:
        n = r.count(5)
        return tuple((r.i32(), r.bool()) for _ in range(n))
    if kind == _INT:
        return r.i32()
    raise LocalProtocolError(f"unknown field kind {kind}")  # pragma: no cover


class _Message:
    """Base of every message: its type code, the first codec version that has it and its field layout."""

    __slots__ = ()

    TYPE: ClassVar[MessageType]
    MIN_VERSION: ClassVar[int] = 0
    # Kinds of the fields after the ReqId, in wire order; None for messages with their own codec methods.
    # _FIELDS (set below, once per class) names the dataclass fields in declaration order = wire order.
    _FIELDS: ClassVar[tuple[str, ...]] = ()
    _KINDS: ClassVar[tuple[str, ...] | None] = ()

    req_id: ReqId

    def _encode(self, version: int) -> bytes:
        kinds = self._KINDS
        if kinds is None:  # pragma: no cover - classes without _KINDS override _encode
            raise NotImplementedError(type(self).__name__)
        w = Writer()
        w.buf += _prefix(self.TYPE, self.req_id)
        # Dataclass slots are the fields in declaration order; the first is req_id, written above.
        self._check(LocalProtocolError)
        for name, kind in zip(self._FIELDS[1:], kinds, strict=True):
            _write_field(w, kind, getattr(self, name))
        return w.getvalue()

    def _check(self, error: type[LocalProtocolError | RemoteProtocolError]) -> None:
        """Raise ``error`` for field values the protocol has no meaning for (encode and decode alike)."""

    @classmethod
    def _decode(cls, payload: bytes | bytearray | memoryview, version: int) -> _Message:
        kinds = cls._KINDS
        if kinds is None:  # pragma: no cover - classes without _KINDS override _decode
            raise NotImplementedError(cls.__name__)
        r = Reader(payload)
        r._take(1)  # the type byte, already checked by decode()
        req_id = ReqId(r.u64(), r.u64())
        values = [_read_field(r, kind) for kind in kinds]
        r.expect_end()
        msg = cls(req_id, *values)  # type: ignore[call-arg]
        msg._check(RemoteProtocolError)
        return msg


def _prefix(type_code: int, req_id: ReqId) -> bytes:
    return _PREFIX.pack(type_code, req_id.msb & _MASK64, req_id.lsb & _MASK64)


def _fields_layout(cls: type[_Message]) -> None:
    """Check at import time that each generic message lists one kind per field after its ReqId."""
    names = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    kinds = cls._KINDS
    if names[0] != "req_id" or (kinds is not None and len(names) != len(kinds) + 1):  # pragma: no cover
        raise TypeError(f"{cls.__name__}: fields {names} do not match the kinds {kinds}")
    cls._FIELDS = names


# The generic _encode walks the dataclass fields after ``req_id``, so the field order of each class IS the
# wire order. ``_KINDS`` lists the kind of each of those fields.


def _check_high_water_mark(
    msg: _Message, hwm: int, error: type[LocalProtocolError | RemoteProtocolError]
) -> None:
    """A client's high-water mark is -1 (it holds nothing yet) or a transaction id. One below -1 would start a
    feed at ids that never exist, which the server's feed task would poll for ever: the codec refuses it."""
    if hwm < -1:
        raise error(f"{type(msg).__name__}: client high-water mark {hwm} is below -1")


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


def _read_req_id(payload: bytes | bytearray | memoryview) -> ReqId:
    if len(payload) < _PREFIX_BYTES:
        raise RemoteProtocolError(f"message truncated: {len(payload)} bytes, a ReqId needs {_PREFIX_BYTES}")
    _, msb, lsb = _PREFIX.unpack_from(payload, 0)
    return ReqId(msb, lsb)


def _truncated(need: int, have: int) -> RemoteProtocolError:
    return RemoteProtocolError(f"message truncated: need {need} bytes, have {have}")


def _read_locks(
    payload: bytes | bytearray | memoryview, pos: int, end: int, n: int
) -> tuple[tuple[int, ...], int]:
    """Read ``n`` lock hashes at ``pos`` (the count already read); return them and the next position."""
    if n < 0:
        if n == -1:  # Java's null array: no locks
            return (), pos
        raise RemoteProtocolError(f"negative lock count {n}")
    stop = pos + 4 * n
    if stop > end:  # checked before unpacking, so a forged count cannot allocate
        raise _truncated(stop, end)
    if n < len(_LOCK_LISTS):
        return _LOCK_LISTS[n].unpack_from(payload, pos), stop
    return struct.unpack_from(f">{n}i", payload, pos), stop


_LOCK_LISTS = tuple(struct.Struct(f">{n}i") for n in range(9))
_WRITE_LOCKS_HEADS = tuple(_append_head_v2(n, 0, 0) for n in range(9))
"""V2+ AppendRequest heads with ``n`` write locks and no others, precompiled for the decoder's fast path."""
"""Precompiled ``n x i32`` for the lock counts appends nearly always carry (one lock, a few)."""


@dataclass(frozen=True, slots=True)
class AppendRequest(_Message):
    """Append one transaction, guarded by optimistic locks checked against ``client_high_water_mark``.

    Lock values are the 32-bit hashes of :class:`waltz.client.locks.PartitionLocalLock`. ``checksum`` is the
    unsigned CRC-32 of ``data``; use :meth:`build` to compute it.
    """

    TYPE: ClassVar[MessageType] = MessageType.APPEND_REQUEST
    _KINDS: ClassVar[tuple[str, ...] | None] = None

    req_id: ReqId
    client_high_water_mark: int
    write_locks: tuple[int, ...]
    read_locks: tuple[int, ...]
    append_locks: tuple[int, ...]
    header: int
    data: bytes
    checksum: int

    @classmethod
    def build(
        cls,
        req_id: ReqId,
        client_high_water_mark: int,
        header: int,
        data: bytes,
        write_locks: tuple[int, ...] = (),
        read_locks: tuple[int, ...] = (),
        append_locks: tuple[int, ...] = (),
    ) -> AppendRequest:
        """An AppendRequest whose checksum is the CRC-32 of ``data``."""
        return cls(
            req_id,
            client_high_water_mark,
            write_locks,
            read_locks,
            append_locks,
            header,
            data,
            crc32(data),
        )

    def _encode(self, version: int) -> bytes:
        w, r, a = self.write_locks, self.read_locks, self.append_locks
        nw, nr, na = len(w), len(r), len(a)
        data = self.data
        try:
            if version >= 2 and not (nw or nr or na):
                # The common append, without locks: one precompiled struct instead of a format per call.
                msb, lsb = self.req_id
                head = _APPEND_HEAD_NO_LOCKS.pack(
                    2,
                    msb & _MASK64,
                    lsb & _MASK64,
                    self.client_high_water_mark,
                    0,
                    0,
                    0,
                    self.header,
                    len(data),
                )
            elif version >= 2 and nw == 1 and not (nr or na):
                # One write lock (a conditional append on one key): precompiled too, no argument unpacking.
                msb, lsb = self.req_id
                head = _APPEND_HEAD_ONE_WRITE.pack(
                    2,
                    msb & _MASK64,
                    lsb & _MASK64,
                    self.client_high_water_mark,
                    1,
                    w[0],
                    0,
                    0,
                    self.header,
                    len(data),
                )
            elif version >= 2:
                head = _append_head_v2(nw, nr, na).pack(
                    2,
                    self.req_id.msb & _MASK64,
                    self.req_id.lsb & _MASK64,
                    self.client_high_water_mark,
                    nw,
                    *w,
                    nr,
                    *r,
                    na,
                    *a,
                    self.header,
                    len(data),
                )
            else:
                if na:
                    raise LocalProtocolError(
                        f"append locks need codec V2, V{version} is in use: not supported, upgrade servers"
                    )
                if version == 1:
                    head = struct.pack(
                        f">BQQqi{nw}ii{nr}iii",
                        2,
                        self.req_id.msb & _MASK64,
                        self.req_id.lsb & _MASK64,
                        self.client_high_water_mark,
                        nw,
                        *w,
                        nr,
                        *r,
                        self.header,
                        len(data),
                    )
                else:
                    if nr:
                        raise LocalProtocolError(
                            "read locks need codec V1, V0 is in use: not supported, upgrade servers"
                        )
                    head = struct.pack(
                        f">BQQqi{nw}iii",
                        2,
                        self.req_id.msb & _MASK64,
                        self.req_id.lsb & _MASK64,
                        self.client_high_water_mark,
                        nw,
                        *w,
                        self.header,
                        len(data),
                    )
            tail = _U32.pack(self.checksum)
        except struct.error as e:
            raise LocalProtocolError(f"AppendRequest field out of range: {e}") from None
        return b"".join((head, data, tail))

    @classmethod
    def _decode(cls, payload: bytes | bytearray | memoryview, version: int) -> AppendRequest:
        return new_append_request(*decode_append_fields(payload, version))


class AppendFields(NamedTuple):
    """An AppendRequest's fields as :func:`decode_append_fields` reads them: what a server's hot path needs
    of the message (the same names and values as :class:`AppendRequest`'s), built in one C call instead of
    a frozen dataclass's eight slot setters."""

    req_id: ReqId
    client_high_water_mark: int
    write_locks: tuple[int, ...]
    read_locks: tuple[int, ...]
    append_locks: tuple[int, ...]
    header: int
    data: bytes
    checksum: int


AppendMessage = AppendRequest | AppendFields
"""An append as the server handles it: decoded on its hot path (:class:`AppendFields`) or a message."""


def decode_append_fields(payload: bytes | bytearray | memoryview, version: int) -> AppendFields:
    """:func:`decode_append_request` as :class:`AppendFields`: the same checks and errors (it is the
    decoder's one implementation), without the message object (the server decodes one per append)."""
    end = len(payload)
    if version >= 2 and end >= _APPEND_HEAD_NO_LOCKS.size + 4:
        # The common appends under V2+, without locks or with a few write locks only: the whole head in
        # one precompiled struct, the fields built in C (a server decodes one per append).
        # Anything else (or anything malformed) takes the general path below, which says what is wrong.
        _, msb, lsb, hwm, nw, nr, na, header, length = _APPEND_HEAD_NO_LOCKS.unpack_from(payload, 0)
        locks: tuple[int, ...] = ()
        head_bytes = _APPEND_HEAD_NO_LOCKS.size
        if nw == 1 and end >= _APPEND_HEAD_ONE_WRITE.size + 4:
            # One write lock (a conditional append on one key): the head read above holds every field of
            # this layout but the length, each one place later than it read them: no second whole unpack.
            locks = (nr,)
            nr, na, header = na, header, length
            length = _I32.unpack_from(payload, _APPEND_HEAD_NO_LOCKS.size)[0]
            head_bytes = _APPEND_HEAD_ONE_WRITE.size
            nw = 0  # read: the test below is of the other counts
        elif 0 < nw < len(_WRITE_LOCKS_HEADS) and end >= _WRITE_LOCKS_HEADS[nw].size + 4:
            head = _WRITE_LOCKS_HEADS[nw]
            head_bytes = head.size
            fields = head.unpack_from(payload, 0)
            locks = fields[5 : 5 + nw]
            nr, na, header, length = fields[5 + nw :]
            nw = 0  # read: the test below is of the other counts
        if not (nw or nr or na) and length >= 0 and head_bytes + length + 4 == end:
            stop = end - 4
            data = bytes(payload[head_bytes:stop])
            checksum: int = _U32.unpack_from(payload, stop)[0]
            if _crc32(data) != checksum:  # both unsigned
                raise _checksum_mismatch(checksum, data)
            return _tuple_new(
                AppendFields, (_tuple_new(ReqId, (msb, lsb)), hwm, locks, (), (), header, data, checksum)
            )
    pos = _APPEND_HEAD.size
    if end < pos:
        raise _truncated(pos, end)
    _, msb, lsb, hwm, n = _APPEND_HEAD.unpack_from(payload, 0)
    # Most appends carry no locks (counts 0, or -1 for Java's null array): skip the general reader then.
    write_locks: tuple[int, ...] = ()
    if n > 0 or n < -1:
        write_locks, pos = _read_locks(payload, pos, end, n)
    read_locks: tuple[int, ...] = ()
    append_locks: tuple[int, ...] = ()
    if version >= 1:
        if pos + 4 > end:
            raise _truncated(pos + 4, end)
        n = _I32.unpack_from(payload, pos)[0]
        pos += 4
        if n > 0 or n < -1:
            read_locks, pos = _read_locks(payload, pos, end, n)
        if version >= 2:
            if pos + 4 > end:
                raise _truncated(pos + 4, end)
            n = _I32.unpack_from(payload, pos)[0]
            pos += 4
            if n > 0 or n < -1:
                append_locks, pos = _read_locks(payload, pos, end, n)
    if pos + 8 > end:
        raise _truncated(pos + 8, end)
    header, length = _HEADER_AND_LENGTH.unpack_from(payload, pos)
    if length < 0:
        raise RemoteProtocolError(f"invalid transaction data length {length}")
    pos += 8
    stop = pos + length
    if stop + 4 != end:
        if stop + 4 > end:
            raise _truncated(stop + 4, end)
        raise RemoteProtocolError(f"{end - stop - 4} unexpected trailing bytes")
    data = bytes(payload[pos:stop])
    checksum = _U32.unpack_from(payload, stop)[0]
    if _crc32(data) != checksum:  # both unsigned
        raise _checksum_mismatch(checksum, data)
    return _tuple_new(
        AppendFields,
        (_tuple_new(ReqId, (msb, lsb)), hwm, write_locks, read_locks, append_locks, header, data, checksum),
    )


def _checksum_mismatch(checksum: int, data: bytes) -> RemoteProtocolError:
    return RemoteProtocolError(
        f"AppendRequest data checksum mismatch: carried {checksum:#010x}, computed {crc32(data):#010x}"
    )


FEED_WINDOW_MAX = 1000
"""Most feed entries a server sends for one FeedRequest (a window: at least the server's
``server.minFetchSize``, at most the client's lag, capped here), after which it sends FeedSuspended and waits
for the next FeedRequest. A client buffers one window per partition without stopping its connection's reads
(``waltz.client.stream.INBOX_FEED_LIMIT`` is above it), so a partition whose application lags stops only its
own feed, never the other partitions on the connection. The mount's catch-up (before READY) has no window."""


@dataclass(frozen=True, slots=True)
class FeedRequest(_Message):
    """Open a feed window: stream transactions after ``client_high_water_mark`` (at most
    :data:`FEED_WINDOW_MAX` of them; the server's config refuses a larger minimum window)."""

    TYPE: ClassVar[MessageType] = MessageType.FEED_REQUEST
    _KINDS: ClassVar[tuple[str, ...] | None] = (_I64,)

    req_id: ReqId
    client_high_water_mark: int

    def _check(self, error: type[LocalProtocolError | RemoteProtocolError]) -> None:
        _check_high_water_mark(self, self.client_high_water_mark, error)


@dataclass(frozen=True, slots=True)
class FeedData(_Message):
    """One committed transaction in the feed; ``req_id`` is the ReqId of its original append."""

    TYPE: ClassVar[MessageType] = MessageType.FEED_DATA
    _KINDS: ClassVar[tuple[str, ...] | None] = None

    req_id: ReqId
    transaction_id: int
    header: int

    def _encode(self, version: int) -> bytes:
        try:
            return _FEED_DATA.pack(
                4, self.req_id.msb & _MASK64, self.req_id.lsb & _MASK64, self.transaction_id, self.header
            )
        except struct.error as e:
            raise LocalProtocolError(f"FeedData field out of range: {e}") from None

    @classmethod
    def _decode(cls, payload: bytes | bytearray | memoryview, version: int) -> FeedData:
        if len(payload) != _FEED_DATA.size:
            if len(payload) < _FEED_DATA.size:
                raise _truncated(_FEED_DATA.size, len(payload))
            raise RemoteProtocolError(f"{len(payload) - _FEED_DATA.size} unexpected trailing bytes")
        _, msb, lsb, txn, header = _FEED_DATA.unpack_from(payload, 0)
        return cls(ReqId(msb, lsb), txn, header)


@dataclass(frozen=True, slots=True)
class FeedSuspended(_Message):
    """The feed window is used up; the client should send a new FeedRequest."""

    TYPE: ClassVar[MessageType] = MessageType.FEED_SUSPENDED

    req_id: ReqId


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
class CheckStorageConnectivityRequest(_Message):
    """Admin: ask the server which storage nodes it can reach (V1+)."""

    TYPE: ClassVar[MessageType] = MessageType.CHECK_STORAGE_CONNECTIVITY_REQUEST
    MIN_VERSION: ClassVar[int] = 1

    req_id: ReqId


@dataclass(frozen=True, slots=True)
class CheckStorageConnectivityResponse(_Message):
    """Admin: ``(storage connect string, reachable)`` for each storage node, in the server's order (V1+)."""

    TYPE: ClassVar[MessageType] = MessageType.CHECK_STORAGE_CONNECTIVITY_RESPONSE
    MIN_VERSION: ClassVar[int] = 1
    _KINDS: ClassVar[tuple[str, ...] | None] = (_STR_BOOLS,)

    req_id: ReqId
    storage_connectivity: tuple[tuple[str, bool], ...]


@dataclass(frozen=True, slots=True)
class ServerPartitionsAssignmentRequest(_Message):
    """Admin: ask which partitions the server owns (V2+)."""

    TYPE: ClassVar[MessageType] = MessageType.SERVER_PARTITIONS_ASSIGNMENT_REQUEST
    MIN_VERSION: ClassVar[int] = 2

    req_id: ReqId


@dataclass(frozen=True, slots=True)
class ServerPartitionsAssignmentResponse(_Message):
    """Admin: the partitions the server owns (V2+)."""

    TYPE: ClassVar[MessageType] = MessageType.SERVER_PARTITIONS_ASSIGNMENT_RESPONSE
    MIN_VERSION: ClassVar[int] = 2
    _KINDS: ClassVar[tuple[str, ...] | None] = (_INTS,)

    req_id: ReqId
    partition_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AddPreferredPartitionRequest(_Message):
    """Admin: make the server the preferred owner of these partitions (V2+)."""

    TYPE: ClassVar[MessageType] = MessageType.ADD_PREFERRED_PARTITION_REQUEST
    MIN_VERSION: ClassVar[int] = 2
    _KINDS: ClassVar[tuple[str, ...] | None] = (_INTS,)

    req_id: ReqId
    partition_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AddPreferredPartitionResponse(_Message):
    """Admin: whether adding the preferred partitions succeeded (V2+)."""

    TYPE: ClassVar[MessageType] = MessageType.ADD_PREFERRED_PARTITION_RESPONSE
    MIN_VERSION: ClassVar[int] = 2
    _KINDS: ClassVar[tuple[str, ...] | None] = (_BOOL,)

    req_id: ReqId
    result: bool


@dataclass(frozen=True, slots=True)
class RemovePreferredPartitionRequest(_Message):
    """Admin: stop preferring the server for these partitions (V2+)."""

    TYPE: ClassVar[MessageType] = MessageType.REMOVE_PREFERRED_PARTITION_REQUEST
    MIN_VERSION: ClassVar[int] = 2
    _KINDS: ClassVar[tuple[str, ...] | None] = (_INTS,)

    req_id: ReqId
    partition_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RemovePreferredPartitionResponse(_Message):
    """Admin: whether removing the preferred partitions succeeded (V2+)."""

    TYPE: ClassVar[MessageType] = MessageType.REMOVE_PREFERRED_PARTITION_RESPONSE
    MIN_VERSION: ClassVar[int] = 2
    _KINDS: ClassVar[tuple[str, ...] | None] = (_BOOL,)

    req_id: ReqId
    result: bool


@dataclass(frozen=True, slots=True)
class ServerPartitionsHealthStatRequest(_Message):
    """Admin: ask for the health of each partition the server owns (V4)."""

    TYPE: ClassVar[MessageType] = MessageType.SERVER_PARTITIONS_HEALTH_STAT_REQUEST
    MIN_VERSION: ClassVar[int] = 4

    req_id: ReqId


@dataclass(frozen=True, slots=True)
class ServerPartitionsHealthStatResponse(_Message):
    """Admin: ``(partition id, healthy)`` for each partition the server owns (V4)."""

    TYPE: ClassVar[MessageType] = MessageType.SERVER_PARTITIONS_HEALTH_STAT_RESPONSE
    MIN_VERSION: ClassVar[int] = 4
    _KINDS: ClassVar[tuple[str, ...] | None] = (_INT_BOOLS,)

    req_id: ReqId
    partition_health: tuple[tuple[int, bool], ...]


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


Message = (
    MountRequest
    | MountResponse
    | AppendRequest
    | FeedRequest
    | FeedData
    | FeedSuspended
    | TransactionDataRequest
    | TransactionDataResponse
    | FlushRequest
    | FlushResponse
    | LockFailure
    | HighWaterMarkRequest
    | HighWaterMarkResponse
    | CheckStorageConnectivityRequest
    | CheckStorageConnectivityResponse
    | ServerPartitionsAssignmentRequest
    | ServerPartitionsAssignmentResponse
    | AddPreferredPartitionRequest
    | AddPreferredPartitionResponse
    | RemovePreferredPartitionRequest
    | RemovePreferredPartitionResponse
    | ServerPartitionsHealthStatRequest
    | ServerPartitionsHealthStatResponse
    | TransactionRangeRequest
    | TransactionRangeResponse
)
"""Any client <-> server message."""

_CLASSES: tuple[type[_Message], ...] = (
    MountRequest,
    MountResponse,
    AppendRequest,
    FeedRequest,
    FeedData,
    FeedSuspended,
    TransactionDataRequest,
    TransactionDataResponse,
    FlushRequest,
    FlushResponse,
    LockFailure,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    CheckStorageConnectivityRequest,
    CheckStorageConnectivityResponse,
    ServerPartitionsAssignmentRequest,
    ServerPartitionsAssignmentResponse,
    AddPreferredPartitionRequest,
    AddPreferredPartitionResponse,
    RemovePreferredPartitionRequest,
    RemovePreferredPartitionResponse,
    ServerPartitionsHealthStatRequest,
    ServerPartitionsHealthStatResponse,
    TransactionRangeRequest,
    TransactionRangeResponse,
)

for _code, _cls in enumerate(_CLASSES):
    if _code != _cls.TYPE:  # pragma: no cover - a bug in this module
        raise TypeError(f"{_cls.__name__} has type {_cls.TYPE}, expected {_code}")
    _fields_layout(_cls)

# Per type code: (first version that has it, decoder); indexed by the type byte.
_DECODERS: tuple[tuple[int, Callable[[bytes | bytearray | memoryview, int], _Message]], ...] = tuple(
    (cls.MIN_VERSION, cls._decode) for cls in _CLASSES
)


def _check_version(version: int) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise LocalProtocolError(f"unsupported client-server codec version {version}")


def encode(msg: Message, version: int) -> bytes:
    """The payload of ``msg`` under codec ``version`` (no frame header).

    Raises LocalProtocolError if the version cannot carry the message (see the module docstring).
    """
    _check_carries(msg, version)
    return msg._encode(version)


def encode_range_response_parts(msg: TransactionRangeResponse, version: int) -> tuple[bytes, RunBytes]:
    """``encode(msg, version)`` as ``(head, run)``, the run not copied: a server relays a storage node's run
    after the head (``FramedConnection.send(head, body)``) instead of joining megabytes into one payload.
    Raises as :func:`encode`."""
    _check_carries(msg, version)
    return msg._head(), msg.run


def _check_carries(msg: Message, version: int) -> None:
    if version not in SUPPORTED_VERSIONS:
        _check_version(version)
    if version < msg.MIN_VERSION:
        raise LocalProtocolError(
            f"{type(msg).__name__} needs codec V{msg.MIN_VERSION} but V{version} is in use: "
            "not supported, upgrade servers"
        )


append_payload: Final[Callable[[AppendRequest, int], bytes]] = AppendRequest._encode
"""``encode(request, version)`` for an AppendRequest on a negotiated connection, without the version checks
(every codec version carries it): the client's hot path, one call per append less."""

_FRAMED_APPEND_HEADS: Final = (
    # Frame header (magic, version, length) and the V2+ AppendRequest head in one struct, by the number of
    # write locks (none or one, no read or append locks: the appends clients send). The ReqId halves are
    # packed signed: the same bytes as the unsigned halves encode() writes, without masking them.
    struct.Struct(">BhiBqqqiiiii"),
    struct.Struct(">BhiBqqqiiiiii"),
)


def frame_append(
    out: list[bytes],
    magic: int,
    version: int,
    max_frame_bytes: int,
    req_id: ReqId,
    client_high_water_mark: int,
    write_locks: tuple[int, ...],
    header: int,
    data: bytes,
) -> bool:
    """Append to ``out`` the bytes of the frame (``magic``, ``version``) whose payload is the AppendRequest
    ``(req_id, client_high_water_mark, write_locks, (), (), header, data, crc32(data))`` under codec
    ``version``, and return True; or return False, having appended nothing, if this shortcut does not cover
    it (a codec before V2, more than one write lock, a field out of range, a payload over
    ``max_frame_bytes``: :func:`encode` the message then, and let the connection refuse it).

    The same bytes as framing ``encode(AppendRequest(...), version)``, in one pass without a message object
    or a copy of ``data`` (the client's hot path: its appends are framed by the stream connection in one
    buffer per loop iteration)."""
    if version < 2 or len(write_locks) > 1:
        return False
    n = len(data)
    head = _FRAMED_APPEND_HEADS[len(write_locks)]
    size = head.size - FRAME_HEADER_BYTES + n + 4
    if size > max_frame_bytes:
        return False
    msb, lsb = req_id
    try:
        # nw and its write locks (none or one), then nr = na = 0: the layout's counts, each before its locks.
        prefix = head.pack(
            magic,
            version,
            size,
            2,
            msb,
            lsb,
            client_high_water_mark,
            len(write_locks),
            *write_locks,
            0,
            0,
            header,
            n,
        )
        tail = _U32.pack(_crc32(data))
    except struct.error:
        return False  # Out of range (an unsigned ReqId half above 2**63 among them): the general path.
    out.append(prefix)
    out.append(data)
    out.append(tail)
    return True


decode_append_request: Final[Callable[[bytes | bytearray | memoryview, int], AppendRequest]] = (
    AppendRequest._decode
)
"""``decode(payload, version)`` for a payload whose type byte is APPEND_REQUEST (every codec version carries
it), on a negotiated connection: without the version and type dispatch, the server's hot path. Raises as
:func:`decode` does."""


_APPEND_SLOT_SETTERS = tuple(
    AppendRequest.__dict__[f.name].__set__ for f in dataclasses.fields(AppendRequest)
)


def new_append_request(
    req_id: ReqId,
    client_high_water_mark: int,
    write_locks: tuple[int, ...],
    read_locks: tuple[int, ...],
    append_locks: tuple[int, ...],
    header: int,
    data: bytes,
    checksum: int,
) -> AppendRequest:
    """``AppendRequest(...)`` with the same arguments, built through its slots' setters: a frozen dataclass's
    ``__init__`` pays an ``object.__setattr__`` lookup per field (twice the cost, on a client's hot path)."""
    msg = object.__new__(AppendRequest)
    s0, s1, s2, s3, s4, s5, s6, s7 = _APPEND_SLOT_SETTERS
    s0(msg, req_id)
    s1(msg, client_high_water_mark)
    s2(msg, write_locks)
    s3(msg, read_locks)
    s4(msg, append_locks)
    s5(msg, header)
    s6(msg, data)
    s7(msg, checksum)
    return msg


_FEED_DATA_TYPE: Final = int(MessageType.FEED_DATA)


def decode_feed_data(payload: bytes | bytearray | memoryview) -> tuple[ReqId, int, int] | None:
    """``(req_id, transaction_id, header)`` if ``payload`` is a well-formed FeedData (any codec version),
    else None (then :func:`decode` it). The client's feed reader takes most messages this way, without a
    message object: the feed is the bulk of what a client receives."""
    if len(payload) != _FEED_DATA.size or payload[0] != _FEED_DATA_TYPE:
        return None
    _, msb, lsb, transaction_id, header = _FEED_DATA.unpack_from(payload, 0)
    # ReqId(msb, lsb) built in C, without its generated __new__ (one per feed entry).
    return _tuple_new(ReqId, (msb, lsb)), transaction_id, header


FeedEntry: TypeAlias = tuple[int, ReqId, int]
"""``(transaction_id, req_id, header)`` of one FeedData, as :func:`decode_feed_run` returns it."""


def decode_feed_run(
    payloads: Sequence[bytes | bytearray | memoryview], start: int
) -> tuple[int, list[FeedEntry], int]:
    """The run of well-formed FeedData payloads of one partition at ``payloads[start:]``, decoded in one pass
    (the client's feed reader takes a burst of a read this way): ``(partition, entries, end)`` where
    ``entries`` are those of ``payloads[start:end]``, in order, and ``partition`` is their ReqId's partition
    id read unsigned (as the reader looks it up). ``entries`` is empty when ``payloads[start]`` is not a
    well-formed FeedData (then :func:`decode` it). Each entry is what :func:`decode_feed_data` returns."""
    size = _FEED_DATA.size
    unpack = _FEED_DATA.unpack_from
    code = _FEED_DATA_TYPE
    entries: list[FeedEntry] = []
    partition = -1
    end = start
    for payload in itertools.islice(payloads, start, None):
        if len(payload) != size or payload[0] != code:
            break
        _, msb, lsb, transaction_id, header = unpack(payload, 0)
        p = lsb >> 32 & 0xFFFFFFFF
        if p != partition:
            if entries:
                break  # Another partition's run starts here.
            partition = p
        entries.append((transaction_id, _tuple_new(ReqId, (msb, lsb)), header))
        end += 1
    return partition, entries, end


def encode_feed_data(headers: Iterable[RecordHeader], version: int) -> list[bytes]:
    """The payloads of ``FeedData(h.req_id, h.transaction_id, h.header)`` for each of ``headers``: the same
    bytes as :func:`encode` of each, without building the messages (the server's feed sends one per
    commit)."""
    if version not in SUPPORTED_VERSIONS:
        _check_version(version)
    pack = _FEED_DATA.pack
    code = int(MessageType.FEED_DATA)
    try:
        return [pack(code, msb & _MASK64, lsb & _MASK64, txn, header) for txn, (msb, lsb), header in headers]
    except struct.error as e:
        raise LocalProtocolError(f"FeedData field out of range: {e}") from None


def encode_feed_entries(entries: Iterable[tuple[int, int, int, int]], version: int) -> list[bytes]:
    """:func:`encode_feed_data` of flat ``(transaction id, ReqId msb, ReqId lsb, header)`` tuples, the halves
    as unsigned 64-bit values (as a feed cache unpacks them): no RecordHeader per entry."""
    if version not in SUPPORTED_VERSIONS:
        _check_version(version)
    pack = _FEED_DATA.pack
    code = int(MessageType.FEED_DATA)
    try:
        return [pack(code, msb, lsb, txn, header) for txn, msb, lsb, header in entries]
    except struct.error as e:
        raise LocalProtocolError(f"FeedData field out of range: {e}") from None


def frame_feed_entries(entries: Sequence[tuple[int, int, int, int]], version: int) -> bytes:
    """:func:`encode_feed_entries` as whole frames of the client protocol (``MAGIC_CLIENT``, ``version``), in
    one buffer: what the server's feed hands to ``FramedConnection.send(..., framed=True)``. Every FeedData
    has one size, so the frames share one header, joined in C."""
    payloads = encode_feed_entries(entries, version)
    if not payloads:
        return b""
    header = FRAME_HEADER.pack(MAGIC_CLIENT, version, _FEED_DATA.size)
    return header + header.join(payloads)


def decode(payload: bytes | bytearray | memoryview, version: int) -> Message:
    """The one message in ``payload`` (a whole frame payload) under codec ``version``.

    Returns a whole message or raises RemoteProtocolError (see the module docstring); never anything else.
    """
    if version not in SUPPORTED_VERSIONS:
        _check_version(version)
    if not payload:
        raise RemoteProtocolError("empty client-server message")
    code = payload[0]
    if code >= len(_DECODERS):
        raise RemoteProtocolError(f"unknown client-server message type {code}")
    min_version, decoder = _DECODERS[code]
    if version < min_version:
        raise RemoteProtocolError(
            f"message type {code} ({_CLASSES[code].__name__}) is not part of codec V{version}"
        )
    return decoder(payload, version)  # type: ignore[return-value]
