"""GroupDescriptor: the replica group of each storage node, at ``<root>/store/group``.

Encoding (big-endian, see :mod:`waltz.cluster.codec`)::

    u8   format version   (1)
    i32  n                number of storage nodes
    n x:
        utf  storage connect string (host:port)
        i32  group id

Groups are meant to be regions that each hold a full copy of every partition; the CLI refuses to remove a
group's last copy of a partition. Nodes are written in sorted order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from waltz.cluster.codec import Reader, Writer

FORMAT_VERSION = 1


@dataclass(frozen=True)
class GroupDescriptor:
    """Storage connect string -> group id."""

    groups: Mapping[str, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        w = Writer().u8(FORMAT_VERSION).i32(len(self.groups))
        for storage in sorted(self.groups):
            w.utf(storage).i32(self.groups[storage])
        return w.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> GroupDescriptor:
        r = Reader(raw, "group descriptor")
        r.version(FORMAT_VERSION)
        groups: dict[str, int] = {}
        for _ in range(r.count()):
            storage = r.utf()
            groups[storage] = r.i32()
        r.finish()
        return cls(groups)

    def members(self, group: int) -> list[str]:
        return sorted(s for s, g in self.groups.items() if g == group)
