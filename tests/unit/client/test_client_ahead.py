"""A client whose CLIENT_AHEAD outlives an owner change: the whole client (core and network driver) against
scripted in-process servers (no ZooKeeper). CLIENT_AHEAD is final only against the incarnation that said it:
a stale incarnation of a partition may answer a newer generation's mount before the new one opens."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

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


class CountingLoop(asyncio.SelectorEventLoop):
    """Counts the loop's iterations: a client that retries without a wait shows as thousands of them."""

    iterations = 0

    def _run_once(self) -> None:
        self.iterations += 1
        super()._run_once()  # type: ignore[misc]


class SilentOwner(ScriptedOwner):
    """Mounts as READY and never answers an append (they stay in flight)."""

    def answer(self, conn: FramedConnection, msg: cs.Message) -> None:
        if not isinstance(msg, cs.AppendRequest):
            super().answer(conn, msg)


IDLE_S = 0.3
"""How long the tests watch an idle client with a CLIENT_AHEAD partition (nudges every 25 ms)."""
MAX_IDLE_ITERATIONS = 200
"""Loop iterations allowed meanwhile: a dozen nudges and the driver's own timers, far below a busy retry."""


async def assert_quiet(client: AsyncWaltzClient, owner: ScriptedOwner) -> None:
    """Watch the idle client (not synchronising: nothing may happen meanwhile): few loop iterations, no
    second mount while the same owner holds the partition, nothing pending."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, CountingLoop)
    before = loop.iterations
    await asyncio.sleep(IDLE_S)
    assert loop.iterations - before < MAX_IDLE_ITERATIONS
    assert len(owner.mounts) == 1
    assert not client.has_pending_transactions()


def run_counting(main: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        runner.run(main)


@pytest.mark.timeout(60)
def test_submits_on_a_client_ahead_partition_fail_at_once_and_nothing_retries_without_a_wait() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, CountingLoop)
        owner = ScriptedOwner(cs.PartitionState.CLIENT_AHEAD, 4)
        discovery = StaticDiscovery()
        discovery.publish({0: (await owner.start(), 5)})
        config = FAST.replace(mount_timeout_ms=10_000, submit_timeout_ms=10_000)
        client = AsyncWaltzClient(
            RecordingCallbacks({0: 10}), config, driver=NetworkDriver(config, discovery=discovery)
        )
        try:
            async with client:
                started = loop.time()
                contexts = [Ctx(str(i).encode()) for i in range(8)]
                results = await asyncio.gather(*(client.submit(c) for c in contexts), return_exceptions=True)
                assert all(isinstance(r, ClientAheadError) for r in results), results
                assert loop.time() - started < 5  # Well before client.mountTimeout and submitTimeout.
                assert all(c.events == ["exception:ClientAheadError"] for c in contexts)
                with pytest.raises(ClientAheadError):
                    await client.wait_applied(0, 11, timeout=5)

                await assert_quiet(client, owner)
        finally:
            await owner.aclose()

    run_counting(main())


@pytest.mark.timeout(60)
def test_appends_in_flight_when_the_partition_answers_client_ahead_end_without_a_busy_retry() -> None:
    async def main() -> None:
        silent = SilentOwner(cs.PartitionState.READY, 10)
        ahead = ScriptedOwner(cs.PartitionState.CLIENT_AHEAD, 4)
        silent_endpoint, ahead_endpoint = await silent.start(), await ahead.start()
        discovery = StaticDiscovery()
        discovery.publish({0: (silent_endpoint, 5)})
        config = FAST.replace(mount_timeout_ms=10_000, answer_timeout_ms=10_000)
        client = AsyncWaltzClient(
            RecordingCallbacks({0: 10}), config, driver=NetworkDriver(config, discovery=discovery)
        )
        try:
            async with client:
                contexts = [Ctx(str(i).encode()) for i in range(8)]
                for ctx in contexts:
                    await client.submit(ctx)  # Sent; the silent owner never answers.
                discovery.publish({0: (ahead_endpoint, 6)})  # A new owner, which finds the client ahead.
                async with asyncio.timeout(5):
                    for ctx in contexts:
                        await asyncio.to_thread(ctx.finished.wait)
                assert all(c.events == ["exception:ClientAheadError"] for c in contexts)
                assert all(c.executions == 1 for c in contexts)  # Not executed again.

                await assert_quiet(client, ahead)
        finally:
            await silent.aclose()
            await ahead.aclose()

    run_counting(main())
