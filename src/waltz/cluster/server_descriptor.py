"""ServerDescriptor: one live Waltz server, the data of ``<root>/serverDescriptors/s_<seq>``.

Each server registers one *ephemeral sequential* znode: it disappears when the server's ZooKeeper session
ends, which is how the coordinator learns that a server is gone. Encoding (big-endian)::

    u8   format version   (1)
    i32  server id        (unique, from the ``<root>/ids/server`` counter)
    utf  host
    i32  port             (the server's client port)
    i32  k
    k x i32 preferred partition id   (ascending)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from waltz.cluster.codec import Reader, Writer

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ServerDescriptor:
    """Identity, address and preferred partitions of a live server."""

    server_id: int
    host: str
    port: int
    preferred_partitions: Sequence[int] = field(default_factory=tuple)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def encode(self) -> bytes:
        prefs = sorted(set(self.preferred_partitions))
        w = Writer().u8(FORMAT_VERSION).i32(self.server_id).utf(self.host).i32(self.port).i32(len(prefs))
        for p in prefs:
            w.i32(p)
        return w.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> ServerDescriptor:
        r = Reader(raw, "server descriptor")
        r.version(FORMAT_VERSION)
        server_id = r.i32()
        host = r.utf()
        port = r.i32()
        prefs = tuple(sorted(r.i32() for _ in range(r.count())))
        r.finish()
        return cls(server_id, host, port, prefs)
