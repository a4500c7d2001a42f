"""PartitionAssignment: which server owns which partition, in which generation.

It is the data of ``<root>/serverDescriptors`` itself (the parent of the servers' ephemeral descriptors), so
one read returns both the assignment and the znode's ``cversion`` (its count of child changes). The
coordinator stamps each assignment with the ``cversion`` of the membership it was computed for; an
assignment whose ``cversion`` differs from the znode's is stale and must not be acted on. Encoding::

    u8   format version   (3, as in the original)
    i32  cversion         membership version this assignment was computed for (-1: never computed)
    i32  number of partitions
    i32  n                number of servers
    n x:
        i32  server id
        i32  k
        k x (i32 partition id, i32 generation)

Servers are written by ascending id and partitions ascending. A server may keep entries after it died: that
is how the next coordinator learns the generation to bump when it moves the dead server's partitions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from waltz.cluster.codec import Reader, Writer
from waltz.errors import MetadataError

FORMAT_VERSION = 3
NOT_COMPUTED = -1


@dataclass(frozen=True)
class PartitionAssignment:
    """``servers``: server id -> {partition id: generation}."""

    cversion: int
    num_partitions: int
    servers: Mapping[int, Mapping[int, int]] = field(default_factory=dict)

    def encode(self) -> bytes:
        w = Writer().u8(FORMAT_VERSION).i32(self.cversion).i32(self.num_partitions).i32(len(self.servers))
        for server_id in sorted(self.servers):
            parts = self.servers[server_id]
            w.i32(server_id).i32(len(parts))
            for p in sorted(parts):
                w.i32(p).i32(parts[p])
        return w.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> PartitionAssignment:
        r = Reader(raw, "partition assignment")
        r.version(FORMAT_VERSION)
        cversion = r.i32()
        num_partitions = r.i32()
        servers: dict[int, dict[int, int]] = {}
        for _ in range(r.count()):
            server_id = r.i32()
            parts: dict[int, int] = {}
            for _ in range(r.count()):
                p = r.i32()
                parts[p] = r.i32()
            servers[server_id] = parts
        r.finish()
        if num_partitions < 0:
            raise MetadataError(f"partition assignment: bad number of partitions {num_partitions}")
        return cls(cversion, num_partitions, servers)

    def generations(self) -> dict[int, int]:
        """Partition -> its highest generation anywhere in this assignment."""
        out: dict[int, int] = {}
        for parts in self.servers.values():
            for p, g in parts.items():
                out[p] = max(g, out.get(p, g))
        return out

    def owner_of(self, partition: int) -> int | None:
        for server_id, parts in self.servers.items():
            if partition in parts:
                return server_id
        return None
