"""Per-partition store metadata, kept in ZooKeeper at ``<root>/store/partition/<id>``.

Written by the owning server (version-checked) whenever it starts a new store session, and by ``waltz
restore`` (:mod:`waltz.ops.restore`) as a store session of its own; read by recovery to classify each replica.
Encoding (Java ``DataOutput`` style, big-endian; ``utf`` = u16 length + UTF-8)::

    u8   format version (1)
    i32  generation
    i64  session id               (the newest store session's id; -1 before the first session)
    i32  n                        number of replica states
    n x ReplicaState:
        u8   format version (1)
        ReplicaId:
            u8   format version (1)
            i32  partition id
            utf  storage connect string (host:port)
        i64  session id           (the store session this replica last took part in cleanly)
        i64  closing high-water mark  (UNRESOLVED = -2**63 while that session is open)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from waltz.errors import MetadataError

FORMAT_VERSION = 1
UNRESOLVED = -(2**63)
"""Closing high-water mark of a replica whose session has not been closed by a recovery yet."""

_HEAD = struct.Struct(">Biqi")
_RS_HEAD = struct.Struct(">BBi")
_RS_TAIL = struct.Struct(">qq")


@dataclass(frozen=True)
class ReplicaState:
    """What ZooKeeper knows of one replica (one storage node's copy of the partition)."""

    storage: str
    session_id: int
    closing_high_water_mark: int = UNRESOLVED


@dataclass(frozen=True)
class PartitionMetadata:
    """Generation, newest store session id and per-replica states of one partition."""

    generation: int = 0
    session_id: int = -1
    replicas: dict[str, ReplicaState] = field(default_factory=dict)

    def encode(self, partition_id: int) -> bytes:
        out = bytearray(_HEAD.pack(FORMAT_VERSION, self.generation, self.session_id, len(self.replicas)))
        for storage in sorted(self.replicas):
            state = self.replicas[storage]
            name = storage.encode("utf-8")
            if len(name) > 0xFFFF:
                raise MetadataError(f"storage connect string too long: {storage[:40]}...")
            out += _RS_HEAD.pack(FORMAT_VERSION, FORMAT_VERSION, partition_id)
            out += struct.pack(">H", len(name)) + name
            out += _RS_TAIL.pack(state.session_id, state.closing_high_water_mark)
        return bytes(out)

    @classmethod
    def decode(cls, raw: bytes) -> PartitionMetadata:
        try:
            version, generation, session_id, n = _HEAD.unpack_from(raw, 0)
            if version != FORMAT_VERSION:
                raise MetadataError(f"unknown partition metadata version {version}")
            if n < 0:
                raise MetadataError(f"negative replica count {n}")
            pos = _HEAD.size
            replicas: dict[str, ReplicaState] = {}
            for _ in range(n):
                v1, v2, _pid = _RS_HEAD.unpack_from(raw, pos)
                if v1 != FORMAT_VERSION or v2 != FORMAT_VERSION:
                    raise MetadataError(f"unknown replica state version {v1}/{v2}")
                pos += _RS_HEAD.size
                (length,) = struct.unpack_from(">H", raw, pos)
                pos += 2
                if pos + length > len(raw):
                    raise MetadataError("partition metadata truncated")
                storage = raw[pos : pos + length].decode("utf-8")
                pos += length
                rs_session, closing = _RS_TAIL.unpack_from(raw, pos)
                pos += _RS_TAIL.size
                replicas[storage] = ReplicaState(storage, rs_session, closing)
            if pos != len(raw):
                raise MetadataError(f"{len(raw) - pos} trailing bytes in partition metadata")
        except (struct.error, UnicodeDecodeError) as e:
            raise MetadataError(f"malformed partition metadata: {e}") from None
        return cls(generation, session_id, replicas)
