"""ReplicaAssignments: which storage node holds a replica of which partitions, at ``<root>/store/assignment``.

Encoding (big-endian, see :mod:`waltz.cluster.codec`)::

    u8   format version   (1)
    i32  n                number of storage nodes
    n x:
        utf  storage connect string (host:port of the node's data port)
        i32  k
        k x i32 partition id

Edited by the ``waltz cluster`` CLI under the admin lock (and a version check); servers watch it to know
where each partition's replicas live. Nodes are written in sorted order and partition ids ascending, so
equal assignments encode to equal bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from waltz.cluster.codec import Reader, Writer

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ReplicaAssignments:
    """Storage connect string -> sorted partition ids."""

    replicas: Mapping[str, Sequence[int]] = field(default_factory=dict)

    def encode(self) -> bytes:
        w = Writer().u8(FORMAT_VERSION).i32(len(self.replicas))
        for storage in sorted(self.replicas):
            parts = sorted(self.replicas[storage])
            w.utf(storage).i32(len(parts))
            for p in parts:
                w.i32(p)
        return w.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> ReplicaAssignments:
        r = Reader(raw, "replica assignments")
        r.version(FORMAT_VERSION)
        replicas: dict[str, list[int]] = {}
        for _ in range(r.count()):
            storage = r.utf()
            replicas[storage] = sorted(r.i32() for _ in range(r.count()))
        r.finish()
        return cls(replicas)

    def partitions_of(self, storage: str) -> list[int]:
        return list(self.replicas.get(storage, ()))

    def storages_of(self, partition: int) -> list[str]:
        return sorted(s for s, parts in self.replicas.items() if partition in parts)
