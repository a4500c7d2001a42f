"""ClusterParams: the cluster's name and partition count, the data of the cluster root znode ``<root>``.

Encoding (big-endian, see :mod:`waltz.cluster.codec`)::

    i32  magic            = Java "Cluster Manager".hashCode() = 0xB4E87347 (marks a Waltz cluster root)
    u8   format version   (1)
    utf  cluster name
    i32  number of partitions

Written once by ``waltz cluster create``; read by every process that joins the cluster. A root without this
magic is not a Waltz cluster (:class:`~waltz.errors.ClusterNotFoundError` is raised by the readers).
"""

from __future__ import annotations

from dataclasses import dataclass

from waltz.cluster.codec import Reader, Writer
from waltz.errors import MetadataError

MAGIC = -1259834553
"""``"Cluster Manager".hashCode()`` in Java, as a signed 32-bit int (0xB4E87347)."""
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ClusterParams:
    """Name and number of partitions of a cluster."""

    name: str
    num_partitions: int

    def encode(self) -> bytes:
        return Writer().i32(MAGIC).u8(FORMAT_VERSION).utf(self.name).i32(self.num_partitions).bytes()

    @classmethod
    def decode(cls, raw: bytes) -> ClusterParams:
        r = Reader(raw, "cluster params")
        if r.i32() != MAGIC:
            raise MetadataError("cluster params: bad magic number (not a Waltz cluster root)")
        r.version(FORMAT_VERSION)
        name = r.utf()
        num_partitions = r.i32()
        r.finish()
        if num_partitions <= 0:
            raise MetadataError(f"cluster params: bad number of partitions {num_partitions}")
        return cls(name, num_partitions)
