"""StoreParams: the cluster key and partition count storage nodes must agree with, at ``<root>/store``.

Encoding (big-endian, see :mod:`waltz.cluster.codec`)::

    u8   format version   (1)
    i64  cluster key, most significant bits   } java.util.UUID, random at ``waltz cluster create``
    i64  cluster key, least significant bits  }
    i32  number of partitions

A storage node compares both fields with its control file at start and refuses to serve a mismatch: the key
keeps a node from ever joining the wrong cluster.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from waltz.cluster.codec import Reader, Writer
from waltz.errors import MetadataError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class StoreParams:
    """Cluster key (a UUID) and number of partitions of the store."""

    cluster_key: uuid.UUID
    num_partitions: int

    def encode(self) -> bytes:
        return Writer().u8(FORMAT_VERSION).uuid(self.cluster_key).i32(self.num_partitions).bytes()

    @classmethod
    def decode(cls, raw: bytes) -> StoreParams:
        r = Reader(raw, "store params")
        r.version(FORMAT_VERSION)
        key = r.uuid()
        num_partitions = r.i32()
        r.finish()
        if num_partitions <= 0:
            raise MetadataError(f"store params: bad number of partitions {num_partitions}")
        return cls(key, num_partitions)
