"""Storage codec V2: several partitions' appends in one request frame (frame magic 'S'), sans-I/O.

A server that writes many partitions to the same storage node has, at any moment, a few appends for many
partitions rather than many appends for one; one request frame per append made the per-request work (frame,
decode, dispatch, response) of both ends the cost of an append. A ``MultiAppendRequest`` carries the appends
of one loop pass for one node in one frame. Its payload (big-endian; primitives as in
:mod:`waltz.protocol.wire`)::

    u8 28 · i64 session_id = -1 · i64 seq_num = -1 · i32 partition_id = -1     the common prefix, unused
    i32 n                                                                    1 <= n <= MAX_MULTI_APPENDS
    n x (i32 length · length bytes: one whole AppendRequest payload, type 6, its own prefix)

Each contained append is exactly the payload :func:`waltz.protocol.storage.encode` makes of an
``AppendRequest`` (its own session id, sequence number and partition id), so the node checks and answers each
as if it had arrived alone, in order: session, fencing, partition ownership, the records' ids and checksums,
and one ``SuccessResponse`` or ``FailureResponse`` per contained append, carrying that append's prefix. There
is no response of the multi request itself (its prefix is all -1, and the decoder refuses anything else).

Bounds: at most :data:`MAX_MULTI_APPENDS` appends, and a sender keeps a frame's contained appends to at
most :data:`MAX_MULTI_APPEND_BYTES` (a single append larger than that goes alone, as an AppendRequest); the
receiver's frame limit bounds the rest. A malformed multi request (a count out of range, a contained message
that is not an AppendRequest or does not decode, trailing bytes) raises
:class:`~waltz.errors.RemoteProtocolError`, naming the item: the node closes that connection (one rate-limited
WARNING line), as for any undecodable request, and none of its appends is written.

Versions: type 28 exists from storage codec V2 on (a decoder below V2 refuses it) and a server sends it only
when the connection negotiated V2 *and* the cluster's feature version is at least
:data:`MULTI_APPEND_FEATURE_VERSION` (see :mod:`waltz.cluster.features`), so a cluster can still roll back to
a release that does not have it until the operator raises the feature version.

Golden bytes: ``MultiAppendRequest((AppendRequest(5, 6, 7, (), False),))`` is
``1c ffffffffffffffff ffffffffffffffff ffffffff 00000001 0000001a
06 0000000000000005 0000000000000006 00000007 00000000 00``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol import storage as st
from waltz.protocol.wire import I32, Reader

__all__ = [
    "MAX_MULTI_APPENDS",
    "MAX_MULTI_APPEND_BYTES",
    "MULTI_APPEND_FEATURE_VERSION",
    "MULTI_APPEND_HEAD",
    "MultiAppendRequest",
    "decode",
    "encode",
    "encode_multi_append",
]

MAX_MULTI_APPENDS: Final = 256
"""The most appends one MultiAppendRequest carries."""
MAX_MULTI_APPEND_BYTES: Final = 1024 * 1024
"""The most bytes of contained appends a sender puts in one MultiAppendRequest (beyond the first)."""
MULTI_APPEND_FEATURE_VERSION: Final = 3
"""The cluster feature version from which servers send MultiAppendRequests."""

_TYPE: Final = 28
_VERSION: Final = 2
MULTI_APPEND_HEAD: Final = st.PREFIX.pack(_TYPE, -1, -1, -1)
"""The prefix every MultiAppendRequest starts with."""


@dataclass(frozen=True, slots=True)
class MultiAppendRequest:
    """Appends for several partitions of one storage node, each answered on its own (see the module)."""

    TYPE: ClassVar[int] = _TYPE
    MIN_VERSION: ClassVar[int] = _VERSION

    appends: Sequence[st.AppendRequest]


def encode_multi_append(parts: Sequence[bytes]) -> bytes:
    """The payload of a MultiAppendRequest carrying ``parts``, each a whole AppendRequest payload (as
    :func:`waltz.protocol.storage.encode_append_request` makes them); LocalProtocolError if there are none
    or more than :data:`MAX_MULTI_APPENDS`."""
    n = len(parts)
    if not 1 <= n <= MAX_MULTI_APPENDS:
        raise LocalProtocolError(f"a multi-append request carries 1 to {MAX_MULTI_APPENDS} appends, not {n}")
    pieces = [MULTI_APPEND_HEAD, I32.pack(n)]
    for part in parts:
        pieces.append(I32.pack(len(part)))
        pieces.append(part)
    return b"".join(pieces)


def encode(msg: MultiAppendRequest) -> bytes:
    """The payload of ``msg`` (its appends encoded as :func:`waltz.protocol.storage.encode` does)."""
    for a in msg.appends:
        if type(a) is not st.AppendRequest:
            raise LocalProtocolError(f"a multi-append request carries AppendRequests, not {type(a).__name__}")
    return encode_multi_append([st.encode(a) for a in msg.appends])


def decode(
    payload: bytes | bytearray | memoryview, version: int = st.STORAGE_VERSIONS[-1]
) -> st.StorageMessage | MultiAppendRequest:
    """:func:`waltz.protocol.storage.decode`, and MultiAppendRequest from codec V2 on (a storage node's
    decoder of requests); raises RemoteProtocolError for anything else than exactly one valid message."""
    if not payload or payload[0] != _TYPE:
        return st.decode(payload, version)
    if version < _VERSION:
        raise RemoteProtocolError(f"storage message type {_TYPE} is not in codec V{version}")
    data = payload if isinstance(payload, bytes) else bytes(payload)
    if data[: st.PREFIX.size] != MULTI_APPEND_HEAD:
        raise RemoteProtocolError("a multi-append request's prefix must be (28, -1, -1, -1)")
    r = Reader(data, st.PREFIX.size)
    n = r.count(4 + st.PREFIX.size)
    if not 1 <= n <= MAX_MULTI_APPENDS:
        raise RemoteProtocolError(f"a multi-append request carries 1 to {MAX_MULTI_APPENDS} appends, not {n}")
    appends = []
    for i in range(n):
        part = r.bytes_required()
        if not part or part[0] != st.AppendRequest.TYPE:
            raise RemoteProtocolError(
                f"append {i} of a multi-append request is "
                + (f"storage message type {part[0]}" if part else "empty")
                + f", not an AppendRequest ({st.AppendRequest.TYPE})"
            )
        try:
            msg = st.decode(part, version)
        except RemoteProtocolError as e:
            raise RemoteProtocolError(f"append {i} of a multi-append request: {e}") from None
        assert isinstance(msg, st.AppendRequest)  # its type byte was checked above
        appends.append(msg)
    r.expect_end()
    return MultiAppendRequest(tuple(appends))
