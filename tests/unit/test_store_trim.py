"""Trim points in the store (memory storages, virtual time): reads below fail with TrimmedError without
asking a replica, every replica of the open session is told, a lagging replica whose catch-up source was
trimmed restarts at the trim point and catches up from there, a trim racing a failover reaches the new
owner's replicas, and damage reported below the trim point is not repaired."""

from __future__ import annotations

import asyncio

import pytest

from waltz.errors import BrokenResourceError, TrimmedError
from waltz.server.store.store_partition import StorePartition
from waltz.testing import run_virtual
from waltz.testing.store import MemoryConnection

from .test_store_session import NAMES, World, req

pytestmark = pytest.mark.timeout(120)


async def _append(partition: StorePartition, first: int, n: int) -> None:
    for i in range(first, first + n):
        assert await partition.append(req(i)) == i


def test_reads_below_fail_and_a_lagging_replica_restarts_at_the_trim_point() -> None:
    async def main() -> None:
        world = World()
        lagging = NAMES[2]
        partition = world.partition()
        await partition.start()
        await _append(partition, 0, 10)
        world.network.isolate(lagging)  # it misses what follows
        await _append(partition, 10, 90)
        partition.set_trim_point(60)
        with pytest.raises(TrimmedError) as e:
            await partition.read_records(59, 5)
        assert (e.value.partition_id, e.value.transaction_id, e.value.trim_point) == (0, 59, 60)
        with pytest.raises(TrimmedError):
            await partition.read_headers(0, 5)
        with pytest.raises(TrimmedError):
            await partition.read_run(10, 5, 1 << 20)
        assert [r.transaction_id for r in await partition.read_records(60, 5)] == [60, 61, 62, 63, 64]
        for name in NAMES[:2]:  # the session's participants were told
            while world.storages[name].partitions[0].trim_point != 60:  # noqa: ASYNC110 - virtual time
                await asyncio.sleep(0.01)
        # The lagging replica comes back: its catch-up source refuses below 60, so it restarts at 60.
        world.network.heal(lagging)
        partition.request_new_session()
        while len(world.log(lagging)) < 100:  # noqa: ASYNC110 - polls storage state on virtual time
            await asyncio.sleep(0.01)
        log = world.log(lagging)
        assert [r.data for r in log[60:]] == [req(i).data for i in range(60, 100)]
        assert world.storages[lagging].partitions[0].trim_point == 60
        await _append(partition, 100, 5)  # appends go on, on every replica
        await partition.close()
        assert world.log(lagging)[104].data == req(104).data

    run_virtual(main())


def test_a_trim_racing_a_failover_reaches_the_new_owners_replicas() -> None:
    async def main() -> None:
        world = World()
        old = world.partition(generation=1)
        await old.start()
        await _append(old, 0, 50)
        old.set_trim_point(30)  # told to the old owner's session just as the partition moves
        new = world.partition(generation=2)
        new.set_trim_point(30)  # the new owner reads it from ZooKeeper before its first session
        await new.start()
        await new.wait_open()
        # Every participant of the new owner's session is told, and so is a replica that joins it late (no
        # new session needed).
        while any(world.storages[n].partitions[0].trim_point != 30 for n in NAMES):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        with pytest.raises(TrimmedError):
            await new.read_records(29, 1)
        assert (await new.read_records(30, 1))[0].data == req(30).data
        await old.close()
        await new.close()

    run_virtual(main())


def test_damage_reported_below_the_trim_point_needs_no_repair() -> None:
    async def main() -> None:
        world = World(damage_poll_interval_ms=50)
        partition = world.partition()
        await partition.start()
        await _append(partition, 0, 40)
        # A replica's scrub reports damaged copies of ids that are (or are about to be) trimmed: no other
        # replica can give them, and none needs to.
        world.storages[NAMES[0]].damage(0, 5)
        world.storages[NAMES[0]].damage(0, 25)
        partition.set_trim_point(20)
        await asyncio.sleep(2)  # many polls
        stats = partition.repairs
        assert (stats.failed, dict(stats.failing)) == (0, {})
        assert world.storages[NAMES[0]].partitions[0].damaged == {5}  # 25 was repaired; 5 was left alone
        await partition.close()

    run_virtual(main())


def test_a_lagging_replica_that_fails_to_restart_at_the_trim_point_does_not_end_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lagging replica's own failure (here its first trim request breaks) is retried by its task; the
    session, whose quorum never depended on it, goes on."""
    lagging = NAMES[2]
    original = MemoryConnection.trim
    failures = [1]

    async def trim_once_broken(self: MemoryConnection, trim_point: int) -> int:
        if self.storage == lagging and failures:
            failures.pop()
            self.break_()
            raise BrokenResourceError(f"connection to {lagging} broke")
        return await original(self, trim_point)

    async def main() -> None:
        world = World()
        partition = world.partition()
        await partition.start()
        await _append(partition, 0, 10)
        world.network.isolate(lagging)
        await _append(partition, 10, 90)
        partition.set_trim_point(60)
        while any(world.storages[n].partitions[0].trim_point != 60 for n in NAMES[:2]):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        session = partition.session
        assert session is not None
        monkeypatch.setattr(MemoryConnection, "trim", trim_once_broken)
        world.network.heal(lagging)
        while len(world.log(lagging)) < 100:  # noqa: ASYNC110 - polls storage state on virtual time
            await asyncio.sleep(0.01)
        assert not failures  # the broken trim request happened
        assert partition.session is session
        assert session.is_open
        await _append(partition, 100, 1)
        await partition.close()

    run_virtual(main())
