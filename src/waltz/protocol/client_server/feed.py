"""The feed: FeedRequest, FeedData and FeedSuspended (types 3-5) and the feed's hot paths, a server encoding
a run of entries in one buffer and a client decoding one without message objects (the format is in
:mod:`waltz.protocol.client_server`)."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, TypeAlias

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol.client_server.base import (
    _I64,
    _MASK64,
    SUPPORTED_VERSIONS,
    MessageType,
    _check_high_water_mark,
    _check_version,
    _Message,
    _truncated,
    _tuple_new,
)
from waltz.protocol.framing import FRAME_HEADER, MAGIC_CLIENT
from waltz.protocol.records import RecordHeader, ReqId

_FEED_DATA = struct.Struct(">BQQqi")  # type, ReqId, transactionId, header


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
"""``(transaction_id, req_id, header)`` of one FeedData, as :func:`decode_feed_runs` returns it."""


def decode_feed_runs(
    payloads: Iterable[bytes | bytearray | memoryview],
) -> list[tuple[int, list[FeedEntry], int]]:
    """The payloads of a burst (the client's feed reader hands it each socket read's), decoded in one pass
    into runs, in order: ``(partition, entries, index)`` for each run of consecutive well-formed FeedData
    payloads of one partition (``entries`` in order, each what :func:`decode_feed_data` returns;
    ``partition`` their ReqId's partition id read unsigned, as the reader looks it up; ``index`` where the
    run starts), and ``(-1, [], index)`` for each payload that is not a well-formed FeedData (then
    :func:`decode` it). Each payload is read once: a burst of many partitions' entries (one commit each)
    costs one call."""
    size = _FEED_DATA.size
    unpack = _FEED_DATA.unpack_from
    code = _FEED_DATA_TYPE
    runs: list[tuple[int, list[FeedEntry], int]] = []
    entries: list[FeedEntry] | None = None
    partition = -1
    for index, payload in enumerate(payloads):
        if len(payload) != size or payload[0] != code:
            runs.append((-1, [], index))
            entries = None
            continue
        _, msb, lsb, transaction_id, header = unpack(payload, 0)
        p = lsb >> 32 & 0xFFFFFFFF
        if p != partition or entries is None:
            partition = p
            entries = []
            runs.append((p, entries, index))
        entries.append((transaction_id, _tuple_new(ReqId, (msb, lsb)), header))
    return runs


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
