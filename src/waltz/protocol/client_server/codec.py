"""The codec's one table: every message class by type code, and :func:`encode` and :func:`decode` over it
(the format is in :mod:`waltz.protocol.client_server`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol.client_server import admin, append, feed, messages
from waltz.protocol.client_server.base import SUPPORTED_VERSIONS, _check_version, _fields_layout, _Message
from waltz.protocol.record_run import RunBytes

Message = (
    messages.MountRequest
    | messages.MountResponse
    | append.AppendRequest
    | feed.FeedRequest
    | feed.FeedData
    | feed.FeedSuspended
    | messages.TransactionDataRequest
    | messages.TransactionDataResponse
    | messages.FlushRequest
    | messages.FlushResponse
    | messages.LockFailure
    | messages.HighWaterMarkRequest
    | messages.HighWaterMarkResponse
    | admin.CheckStorageConnectivityRequest
    | admin.CheckStorageConnectivityResponse
    | admin.ServerPartitionsAssignmentRequest
    | admin.ServerPartitionsAssignmentResponse
    | admin.AddPreferredPartitionRequest
    | admin.AddPreferredPartitionResponse
    | admin.RemovePreferredPartitionRequest
    | admin.RemovePreferredPartitionResponse
    | admin.ServerPartitionsHealthStatRequest
    | admin.ServerPartitionsHealthStatResponse
    | messages.TransactionRangeRequest
    | messages.TransactionRangeResponse
    | messages.TrimmedResponse
)
"""Any client <-> server message; its members in type-code order are the codec's table."""

_CLASSES: tuple[type[_Message], ...] = get_args(Message)
"""Every message class, in type-code order (the order of :data:`Message`)."""

for _code, _cls in enumerate(_CLASSES):
    if _code != _cls.TYPE:  # pragma: no cover - a bug in this module
        raise TypeError(f"{_cls.__name__} has type {_cls.TYPE}, expected {_code}")
    _fields_layout(_cls)

# Per type code: (first version that has it, decoder); indexed by the type byte.
_DECODERS: tuple[tuple[int, Callable[[bytes | bytearray | memoryview, int], _Message]], ...] = tuple(
    (cls.MIN_VERSION, cls._decode) for cls in _CLASSES
)


def encode(msg: Message, version: int) -> bytes:
    """The payload of ``msg`` under codec ``version`` (no frame header).

    Raises LocalProtocolError if the version cannot carry the message (see the module docstring).
    """
    _check_carries(msg, version)
    return msg._encode(version)


def encode_range_response_parts(
    msg: messages.TransactionRangeResponse, version: int
) -> tuple[bytes, RunBytes]:
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
