"""Only a partition's current incarnation answers for it as its owner (issue 24, goal 8).

The server here is a WaltzServer that never started (no ZooKeeper, no listener): its partition table is filled
with small fakes, and its assignment reconciliation and request dispatch are driven directly.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.config import ServerConfig
from waltz.server.server import WaltzServer


class _Incarnation:
    """A partition incarnation as the server sees it; ``close`` waits for ``release`` if given one."""

    def __init__(self, generation: int, high_water_mark: int, release: asyncio.Event | None = None) -> None:
        self.generation = generation
        self.high_water_mark = high_water_mark
        self.is_serving = True
        self.closing = asyncio.Event()
        self._release = release

    async def close(self) -> None:
        self.closing.set()
        if self._release is not None:
            await self._release.wait()


class _Peer:
    def __init__(self) -> None:
        self.sent: list[cs.Message] = []
        self.mounts: dict[int, ReqId | None] = {}
        self.slots = asyncio.Semaphore(8)

    def send(self, msg: cs.Message) -> None:
        self.sent.append(msg)

    def send_range(self, msg: cs.Message) -> None:
        self.sent.append(msg)


def _server() -> WaltzServer:
    keys = {"zookeeper.connectString": "z:1", "cluster.root": "/c", "server.port": 0}
    config = ServerConfig.from_mapping(keys)
    # Never started: ZooKeeper is not touched, and with no replica sets known no new incarnation is opened.
    return WaltzServer(config, cast(Any, None), uuid.uuid4(), 4)


def test_no_incarnation_a_new_assignment_ends_stays_listed_while_another_closes() -> None:
    # Issue 24: the returning owner took partitions 2 and 3 at generation 5 and reopened them one at a time;
    # while partition 2 was being closed, the old incarnation of 3 (generation 3, fenced at 457) was still
    # the server's partition 3 and answered a generation-5 mount with CLIENT_AHEAD.
    async def main() -> None:
        server = _server()
        release = asyncio.Event()
        two, three = _Incarnation(3, 300, release), _Incarnation(3, 457)
        kept = _Incarnation(4, 10)
        server.partitions.update(cast(Any, {1: kept, 2: two, 3: three}))
        task = asyncio.create_task(server._reconcile({1: 4, 2: 5, 3: 5}))
        async with asyncio.timeout(5):
            await two.closing.wait()
        # Partition 2 is closing (its close waits): partition 3's old incarnation is no longer the owner here.
        assert server.partitions == {1: kept}
        peer = _Peer()
        mount = cs.MountRequest(ReqId.of(7, 5, 3, -1), 636, 1)
        await server._dispatch(cast(Any, peer), mount)
        assert peer.sent == [cs.MountResponse(mount.req_id, cs.PartitionState.NOT_READY)]
        release.set()
        async with asyncio.timeout(5):
            await task
        assert three.closing.is_set()
        assert server.partitions == {1: kept}  # the new incarnations need replica sets, which it has none of

    asyncio.run(main())


def test_a_read_naming_a_newer_generation_is_not_answered_from_an_older_incarnation() -> None:
    # A reader takes the high-water mark for the log's end: an incarnation whose generation is over (a zombie
    # owner before it learns so, a store fenced by the new owner) must not give its stale mark as the end.
    async def main() -> None:
        server = _server()
        server.partitions[3] = cast(Any, _Incarnation(3, 457))
        peer = _Peer()
        newer = ReqId.of(7, 5, 3, 1)
        await server._dispatch(cast(Any, peer), cs.HighWaterMarkRequest(newer))
        await server._dispatch(cast(Any, peer), cs.TransactionRangeRequest(newer, 400, 10))
        current = ReqId.of(7, 3, 3, 2)
        await server._dispatch(cast(Any, peer), cs.HighWaterMarkRequest(current))
        assert peer.sent == [
            cs.HighWaterMarkResponse(newer, cs.HWM_NOT_SERVED),
            cs.TransactionRangeResponse(newer, 400, 0, b""),
            cs.HighWaterMarkResponse(current, 457),
        ]

    asyncio.run(main())
