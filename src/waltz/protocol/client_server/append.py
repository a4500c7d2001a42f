"""The AppendRequest (type 2) and its hot paths: the client frames an append in one pass, the server decodes
one into :class:`AppendFields` without a message object (the format is in
:mod:`waltz.protocol.client_server`)."""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Final, NamedTuple

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol.checksum import crc32 as _crc32
from waltz.protocol.client_server.base import (
    _MASK64,
    MessageType,
    _Message,
    _truncated,
    _tuple_new,
)
from waltz.protocol.framing import FRAME_HEADER_BYTES
from waltz.protocol.records import ReqId, crc32

# Module constants, not imported: CPython compiles ``name.method(...)`` of an imported name without
# LOAD_METHOD (it takes the name for a module), which builds a bound method on every call of the hot path.
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")

_APPEND_HEAD = struct.Struct(">BQQqi")  # type, ReqId, clientHighWaterMark, writeLocks count
_APPEND_HEAD_NO_LOCKS = struct.Struct(">BQQqiiiii")  # V2+: type, ReqId, hwm, 0 locks x3, header, length
# V2+ with one write lock and no other (a conditional append on one key): type, ReqId, hwm, 1, the lock, no
# read and no append locks, header, length.
_APPEND_HEAD_ONE_WRITE = struct.Struct(">BQQqiiiiii")


@functools.lru_cache(maxsize=64)
def _append_head_v2(nw: int, nr: int, na: int) -> struct.Struct:
    """The V2+ AppendRequest head for these lock counts, compiled once (appends reuse a few shapes)."""
    return struct.Struct(f">BQQqi{nw}ii{nr}ii{na}iii")


_HEADER_AND_LENGTH = struct.Struct(">ii")


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
                head = self._head_v0_v1(version, len(data))
            tail = _U32.pack(self.checksum)
        except struct.error as e:
            raise LocalProtocolError(f"AppendRequest field out of range: {e}") from None
        return b"".join((head, data, tail))

    def _head_v0_v1(self, version: int, length: int) -> bytes:
        """The head of this append under codec V0 or V1 (no append locks; V0 no read locks either)."""
        w, r = self.write_locks, self.read_locks
        nw, nr = len(w), len(r)
        if self.append_locks:
            raise LocalProtocolError(
                f"append locks need codec V2, V{version} is in use: not supported, upgrade servers"
            )
        if version == 1:
            return struct.pack(
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
                length,
            )
        if nr:
            raise LocalProtocolError("read locks need codec V1, V0 is in use: not supported, upgrade servers")
        return struct.pack(
            f">BQQqi{nw}iii",
            2,
            self.req_id.msb & _MASK64,
            self.req_id.lsb & _MASK64,
            self.client_high_water_mark,
            nw,
            *w,
            self.header,
            length,
        )

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
    return _decode_append_general(payload, version, end)


def _decode_append_general(payload: bytes | bytearray | memoryview, version: int, end: int) -> AppendFields:
    """:func:`decode_append_fields` of any append under any codec version, malformed ones included (they
    raise here, saying what is wrong); ``end`` is the payload's length."""
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
    out += (prefix, data, tail)  # One extend, not three appends.
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
