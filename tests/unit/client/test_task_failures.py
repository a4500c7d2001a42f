"""A failed task of a partition (its mount, its applier) reaches the application: ``uncaught_exception``
hears it, and submits and waits on the partition fail with an error that names it, instead of the
partition stalling while ``submit`` times out with a message about the mount."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from waltz import AsyncWaltzClient
from waltz.client.network import NetworkDriver
from waltz.errors import ClientError, ClientTimeoutError
from waltz.testing import MockDriver

from .helpers import FAST, Ctx, RecordingCallbacks, recording_callbacks


class FailingMountDriver(MockDriver):
    """A MockDriver whose mount of partition 0 fails (a bug in a driver, say)."""

    async def mount(self, partition_id: int, client_high_water_mark: int) -> None:
        if partition_id == 0:
            raise RuntimeError("mount exploded")
        await super().mount(partition_id, client_high_water_mark)


def run(coro: Any) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(30):
            await coro

    asyncio.run(bounded())


async def _reported(callbacks: RecordingCallbacks) -> tuple[int, int, BaseException]:
    async with asyncio.timeout(5):
        while not callbacks.errors:  # noqa: ASYNC110 - the callbacks record on a callback thread
            await asyncio.sleep(0.005)
    return callbacks.errors[0]


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_a_failed_mount_task_stops_its_partition_and_says_why(mode: str) -> None:
    async def main() -> None:
        callbacks = recording_callbacks(mode)
        driver = FailingMountDriver(num_partitions=2)
        client = AsyncWaltzClient(callbacks, FAST.replace(callback_mode=mode), driver=driver)
        async with client:
            partition_id, transaction_id, error = await _reported(callbacks)
            assert (partition_id, transaction_id, str(error)) == (0, -1, "mount exploded")
            ctx = Ctx(b"x", partition=0)
            with pytest.raises(ClientError, match=r"partition 0 stopped.*mount exploded") as caught:
                await client.submit(ctx)
            assert not isinstance(caught.value, ClientTimeoutError)
            assert ctx.events == ["exception:ClientError"]
            # The other partition is not touched.
            other = Ctx(b"y", partition=1)
            await client.submit(other)
            await client.flush_transactions(timeout=5)
            assert other.events == ["completion:True", "application"]

    run(main())


def test_a_failed_applier_task_stops_its_partition_and_says_why() -> None:
    async def main() -> None:
        callbacks = RecordingCallbacks()
        client = AsyncWaltzClient(callbacks, FAST, driver=MockDriver())
        async with client:

            def broken(*args: object) -> None:
                raise RuntimeError("applier exploded")

            client._advance_applied = broken  # type: ignore[method-assign]
            await client.submit(Ctx(b"x"))
            partition_id, transaction_id, error = await _reported(callbacks)
            assert (partition_id, transaction_id, str(error)) == (0, -1, "applier exploded")
            with pytest.raises(ClientError, match=r"partition 0 stopped.*applier exploded"):
                await client.wait_applied(0, 0, timeout=5)
            with pytest.raises(ClientError, match=r"partition 0 stopped.*applier exploded"):
                await client.submit(Ctx(b"y"))

    run(main())


def test_a_failed_mock_driver_task_stops_the_client_s_partitions_and_says_why() -> None:
    # The test double fails as the network driver does: a delivery task that dies (here: a committed record
    # the mock cluster no longer has) stops the driver, and the client hears why instead of waiting for a
    # feed that never comes.
    async def main() -> None:
        callbacks = RecordingCallbacks()
        driver = MockDriver()
        client = AsyncWaltzClient(callbacks, FAST, driver=driver)
        async with client:
            driver.cluster.record = lambda *_: None  # type: ignore[method-assign]
            await client.submit(Ctx(b"x"))
            partition_id, transaction_id, error = await _reported(callbacks)
            assert (partition_id, transaction_id) == (0, -1)
            assert "mock: record 0 of partition 0 vanished" in str(error)
            with pytest.raises(ClientError, match=r"the mock driver stopped: mock-p0-c0-deliver failed"):
                await client.submit(Ctx(b"y"))

    run(main())


class BrokenDiscovery:
    """A Discovery (one partition, no owner yet) whose updates fail once the test says so."""

    num_partitions = 1
    cluster_name = "fake"

    def __init__(self) -> None:
        self.endpoints: dict[int, tuple[str, int]] = {}
        self.fail = asyncio.Event()

    async def open(self) -> None:
        pass

    async def new_client_id(self) -> int:
        return 7

    async def updates(self) -> AsyncIterator[dict[int, tuple[str, int]]]:
        await self.fail.wait()
        raise RuntimeError("watch exploded")
        yield {}  # A generator.

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_a_failed_network_driver_task_stops_every_partition_and_says_why(mode: str) -> None:
    async def main() -> None:
        callbacks = recording_callbacks(mode)
        discovery = BrokenDiscovery()
        driver = NetworkDriver(FAST.replace(callback_mode=mode), discovery=discovery)
        # A plain client with no assignment yet makes no connection: the driver opens at once.
        client = AsyncWaltzClient(callbacks, FAST.replace(callback_mode=mode), driver=driver)
        async with client:
            discovery.fail.set()
            partition_id, transaction_id, error = await _reported(callbacks)
            assert (partition_id, transaction_id, str(error)) == (0, -1, "watch exploded")
            ctx = Ctx(b"x", partition=0)
            with pytest.raises(ClientError, match=r"following the partition assignment failed") as caught:
                await client.submit(ctx)
            assert not isinstance(caught.value, ClientTimeoutError)
            assert ctx.events == ["exception:ClientError"]

    run(main())
