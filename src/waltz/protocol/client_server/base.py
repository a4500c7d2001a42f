"""What every client <-> server message shares: the type codes, the ReqId prefix, the generic field walker and
the message base class (the format is in :mod:`waltz.protocol.client_server`)."""

from __future__ import annotations

import dataclasses
import struct
from enum import IntEnum
from typing import ClassVar

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol.records import ReqId
from waltz.protocol.wire import Reader, Writer

MAGIC = 0x4C
"""Frame magic byte of this codec (``'L'``)."""

SUPPORTED_VERSIONS: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6)
"""Codec versions this module speaks; the hello handshake picks the highest one both peers have."""

_MASK64 = 0xFFFFFFFFFFFFFFFF
_tuple_new = tuple.__new__
"""``_tuple_new(ReqId, (msb, lsb))`` builds a ReqId in C, without its generated ``__new__``."""

_PREFIX = struct.Struct(">BQQ")  # type, ReqId msb, ReqId lsb
_PREFIX_BYTES = _PREFIX.size  # 17


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
    TRIMMED_RESPONSE = 25


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


def _read_req_id(payload: bytes | bytearray | memoryview) -> ReqId:
    if len(payload) < _PREFIX_BYTES:
        raise RemoteProtocolError(f"message truncated: {len(payload)} bytes, a ReqId needs {_PREFIX_BYTES}")
    _, msb, lsb = _PREFIX.unpack_from(payload, 0)
    return ReqId(msb, lsb)


def _truncated(need: int, have: int) -> RemoteProtocolError:
    return RemoteProtocolError(f"message truncated: need {need} bytes, have {have}")


def _check_version(version: int) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise LocalProtocolError(f"unsupported client-server codec version {version}")
