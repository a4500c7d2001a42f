"""The client <-> server message codec (frame magic ``'L'``, codec versions V0..V6), with no I/O.

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
    25   TrimmedResponse                     i64 transactionId · i64 trimPoint                         V6

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
V6 is ours too: 25 answers a TransactionRangeRequest or a MountRequest (same ReqId) whose first transaction
(the range's start; the mount's client high-water mark + 1) is below the partition's trim point, the lowest id
still readable (``0 <= transactionId < trimPoint``, checked both ways). The client raises the non-retriable
:class:`~waltz.errors.TrimmedError`. A V5 peer gets no answer to such a range request and, for such a mount,
a feed that stops at the trim point (it cannot be told), as before V6.

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

The codec is a package, one module per message family, so each can be read alone: :mod:`.base` (type codes,
the ReqId prefix, the generic field walker), :mod:`.append` (AppendRequest and its hot paths), :mod:`.feed`
(the feed and its hot paths), :mod:`.messages` (mount, transaction data and ranges, flush, lock failure,
high-water mark), :mod:`.admin` (the admin messages) and :mod:`.codec` (the table of every message by type
code, :func:`encode` and :func:`decode`). Import them from here.
"""

from __future__ import annotations

from waltz.protocol.client_server.admin import (
    AddPreferredPartitionRequest,
    AddPreferredPartitionResponse,
    CheckStorageConnectivityRequest,
    CheckStorageConnectivityResponse,
    RemovePreferredPartitionRequest,
    RemovePreferredPartitionResponse,
    ServerPartitionsAssignmentRequest,
    ServerPartitionsAssignmentResponse,
    ServerPartitionsHealthStatRequest,
    ServerPartitionsHealthStatResponse,
)
from waltz.protocol.client_server.append import (
    AppendFields,
    AppendMessage,
    AppendRequest,
    decode_append_fields,
    frame_append,
    new_append_request,
)
from waltz.protocol.client_server.append import append_payload as append_payload
from waltz.protocol.client_server.append import decode_append_request as decode_append_request
from waltz.protocol.client_server.base import MAGIC, SUPPORTED_VERSIONS, MessageType, PartitionState
from waltz.protocol.client_server.codec import _CLASSES as _CLASSES
from waltz.protocol.client_server.codec import Message, decode, encode, encode_range_response_parts
from waltz.protocol.client_server.feed import (
    FEED_WINDOW_MAX,
    FeedData,
    FeedEntry,
    FeedRequest,
    FeedSuspended,
    decode_feed_data,
    decode_feed_runs,
)
from waltz.protocol.client_server.feed import encode_feed_data as encode_feed_data
from waltz.protocol.client_server.feed import encode_feed_entries as encode_feed_entries
from waltz.protocol.client_server.feed import frame_feed_entries as frame_feed_entries
from waltz.protocol.client_server.messages import (
    HWM_NOT_SERVED,
    FlushRequest,
    FlushResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    LockFailure,
    MountRequest,
    MountResponse,
    TransactionDataRequest,
    TransactionDataResponse,
    TransactionRangeRequest,
    TransactionRangeResponse,
    TrimmedResponse,
)

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
    "TrimmedResponse",
    "decode",
    "decode_append_fields",
    "decode_feed_data",
    "decode_feed_runs",
    "frame_append",
    "new_append_request",
    "encode",
    "encode_range_response_parts",
]
