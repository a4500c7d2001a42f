"""ConnectionMetadata: the admin port of each storage node, at ``<root>/store/connection``.

Encoding (big-endian, see :mod:`waltz.cluster.codec`)::

    u8   format version   (1)
    i32  n                number of storage nodes
    n x:
        utf  storage connect string (host:port of the data port)
        i32  admin port

Tools use it to reach a node's admin protocol knowing only its data address. Nodes are written sorted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from waltz.cluster.codec import Reader, Writer

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ConnectionMetadata:
    """Storage connect string -> admin port."""

    admin_ports: Mapping[str, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        w = Writer().u8(FORMAT_VERSION).i32(len(self.admin_ports))
        for storage in sorted(self.admin_ports):
            w.utf(storage).i32(self.admin_ports[storage])
        return w.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> ConnectionMetadata:
        r = Reader(raw, "connection metadata")
        r.version(FORMAT_VERSION)
        ports: dict[str, int] = {}
        for _ in range(r.count()):
            storage = r.utf()
            ports[storage] = r.i32()
        r.finish()
        return cls(ports)
