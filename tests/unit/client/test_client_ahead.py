"""A client whose CLIENT_AHEAD outlives an owner change: the whole client (core and network driver) against
scripted in-process servers (no ZooKeeper). CLIENT_AHEAD is final only against the incarnation that said it:
a stale incarnation of a partition may answer a newer generation's mount before the new one opens."""

from __future__ import annotations

import asyncio

import pytest

from waltz import AsyncWaltzClient
from waltz.client.network import NetworkDriver
from waltz.errors import ClientAheadError
from waltz.protocol import client_server as cs
from waltz.transport import FramedConnection

from .helpers import FAST, Ctx, RecordingCallbacks
from .test_network_driver import FakeServer, StaticDiscovery


class ScriptedOwner(FakeServer):
    """A partition owner that answers mounts with ``mount_state`` and commits every append it receives on
    top of ``high_water_mark`` (feed, flush and data requests answered as a server would)."""

    def __init__(self, mount_state: cs.PartitionState, high_water_mark: int) -> None:
        super().__init__()
        self.mount_state = mount_state
        self.high_water_mark = high_water_mark
        self.data: dict[int, bytes] = {}
        self.mounts: list[cs.MountRequest] = []

    async def _handle(self, conn: FramedConnection) -> None:
        while True:
            msg = cs.decode(await conn.receive(), conn.negotiated_version)
            self.answer(conn, msg)

    def answer(self, conn: FramedConnection, msg: cs.Message) -> None:
        if isinstance(msg, cs.MountRequest):
            self.mounts.append(msg)
            self.send(conn, cs.MountResponse(msg.req_id, self.mount_state))
        elif isinstance(msg, cs.AppendRequest):
            self.high_water_mark += 1
            self.data[self.high_water_mark] = bytes(msg.data)
            self.send(conn, cs.FeedData(msg.req_id, self.high_water_mark, msg.header))
        elif isinstance(msg, cs.FlushRequest):
            self.send(conn, cs.FlushResponse(msg.req_id, self.high_water_mark))
        elif isinstance(msg, cs.TransactionDataRequest):
            data = self.data[msg.transaction_id]
            self.send(conn, cs.TransactionDataResponse.success(msg.req_id, msg.transaction_id, data))


@pytest.mark.timeout(60)
def test_a_client_ahead_of_a_stale_owner_gets_its_partition_back_from_the_new_one() -> None:
    async def main() -> None:
        # The stale incarnation lost the tail the client applied (up to 10); the new owner holds it.
        stale = ScriptedOwner(cs.PartitionState.CLIENT_AHEAD, 4)
        current = ScriptedOwner(cs.PartitionState.READY, 10)
        stale_endpoint, current_endpoint = await stale.start(), await current.start()
        discovery = StaticDiscovery()
        discovery.publish({0: (stale_endpoint, 5)})
        config = FAST.replace(mount_timeout_ms=5000)
        callbacks = RecordingCallbacks({0: 10})
        client = AsyncWaltzClient(callbacks, config, driver=NetworkDriver(config, discovery=discovery))
        try:
            async with client:
                with pytest.raises(ClientAheadError, match="ahead"):
                    await client.submit(Ctx(b"refused"))
                assert [m.client_high_water_mark for m in stale.mounts] == [10]

                # The partition moves on (a new owner at a newer generation): asked again, it is served.
                discovery.publish({0: (current_endpoint, 6)})
                ctx = Ctx(b"accepted")
                await client.submit(ctx)
                await client.flush_transactions(timeout=5)
                assert ctx.events == ["completion:True", "application"]
                assert callbacks.data(0) == [b"accepted"]
                assert client.applied_high_water_mark(0) == 11
                assert [(m.req_id.generation, m.client_high_water_mark) for m in current.mounts] == [(6, 10)]
                assert len(stale.mounts) == 1
        finally:
            await stale.aclose()
            await current.aclose()

    asyncio.run(main())
