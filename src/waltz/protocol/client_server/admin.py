"""The server admin messages (types 13-22): storage connectivity, partition assignment, preferred partitions
and partition health (the format is in :mod:`waltz.protocol.client_server`). Each is a generic message: its
fields are listed as kinds and written by the walker of :mod:`~waltz.protocol.client_server.base`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from waltz.protocol.client_server.base import _BOOL, _INT_BOOLS, _INTS, _STR_BOOLS, MessageType, _Message
from waltz.protocol.records import ReqId


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
