"""StorePartition and StoreSession against memory storages: appends, reads, sessions, fencing, backoff."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from tests.fault.simloop import run_virtual
from waltz.errors import (
    ClosedResourceError,
    CorruptionError,
    GenerationMismatchError,
    QuorumLostError,
    SessionFencedError,
)
from waltz.protocol.records import Record, ReqId, crc32
from waltz.server.store import EndReason, ManualClock, StoreConfig
from waltz.server.store.memory import MemoryConnector, MemoryMetadataStore, MemoryNetwork, MemoryStorage
from waltz.server.store.store_partition import StorePartition
from waltz.server.store.support import Backoff

NAMES = ["s0:1", "s1:1", "s2:1"]


@dataclass
class Req:
    req_id: ReqId
    header: int
    data: bytes
    checksum: int


def req(seq: int, generation: int = 1, data: bytes | None = None) -> Req:
    payload = data if data is not None else f"txn-{seq}".encode()
    return Req(ReqId.of(7, generation, 0, seq), seq, payload, crc32(payload))


class World:
    def __init__(self, names: Sequence[str] = NAMES, **config: int) -> None:
        self.network = MemoryNetwork(random.Random(1), min_delay_ms=0.1, max_delay_ms=2.0)
        self.storages = {
            n: MemoryStorage(n, 1, self.network, fsync_ms=(0.1, 1.0), rng=random.Random(i))
            for i, n in enumerate(names)
        }
        self.metadata = MemoryMetadataStore()
        self.config = StoreConfig(**config)

    def partition(self, generation: int = 1, replicas: Sequence[str] = NAMES) -> StorePartition:
        return StorePartition(
            0,
            generation,
            replicas,
            connector=MemoryConnector(self.network),
            metadata_store=self.metadata,
            rng=random.Random(generation),
            config=self.config,
        )

    def log(self, name: str) -> list[Record]:
        return self.storages[name].durable_records(0)


async def _wait(predicate: object, timeout_s: float = 60) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 - polls state on virtual time
            await asyncio.sleep(0.005)


def test_appends_get_dense_ids_and_are_readable() -> None:
    async def main() -> None:
        world = World(max_batch_size=4)
        async with world.partition() as partition:
            ids = await asyncio.gather(*(partition.append(req(i)) for i in range(10)))
            assert ids == list(range(10))
            assert await partition.flush() == 9
            assert partition.high_water_mark == 9
            assert partition.is_healthy
            record = await partition.read_record(3)
            assert record is not None
            assert record.req_id == req(3).req_id
            assert record.verify()
            headers = await partition.read_headers(5, 100)
            assert [h.transaction_id for h in headers] == [5, 6, 7, 8, 9]
            assert await partition.read_record(10) is None
        # Every replica fsynced every committed record.
        await _wait(lambda: all(len(world.log(n)) == 10 for n in NAMES))

    run_virtual(main())


def test_a_minority_failure_does_not_stop_writes() -> None:
    async def main() -> None:
        world = World()
        async with world.partition() as partition:
            assert await partition.append(req(0)) == 0
            world.storages["s2:1"].crash()
            ids = await asyncio.gather(*(partition.append(req(i)) for i in range(1, 6)))
            assert ids == [1, 2, 3, 4, 5]
            world.storages["s2:1"].restart()
            # The next session (started when s2's failure ended this one) catches s2 up.
            await _wait(lambda: len(world.log("s2:1")) == 6)

    run_virtual(main())


def test_appends_wait_while_no_quorum_and_commit_once_it_returns() -> None:
    async def main() -> None:
        world = World()
        async with world.partition() as partition:
            assert await partition.append(req(0)) == 0
            world.storages["s1:1"].crash()
            world.storages["s2:1"].crash()
            await _wait(lambda: not partition.is_healthy)
            # Queued while no session can open: it waits (an append of a batch in flight when a session
            # fails is resolved by the next session instead, see the next test).
            pending = asyncio.ensure_future(partition.append(req(1)))
            await asyncio.sleep(2)
            assert not pending.done()
            assert not partition.is_healthy
            world.storages["s1:1"].restart()
            assert await pending == 1

    run_virtual(main())


def test_in_flight_appends_are_resolved_against_the_next_low_water_mark() -> None:
    async def main() -> None:
        world = World()
        async with world.partition() as partition:
            assert await partition.append(req(0)) == 0
            # Only s0 is reachable: the batch reaches it alone (no quorum). Then s0 dies, s1 and s2 return:
            # the next session resolves 0 as the high-water mark, so the in-flight append definitely failed.
            world.network.isolate("s1:1")
            world.network.isolate("s2:1")
            pending = asyncio.ensure_future(partition.append(req(1)))
            await asyncio.sleep(0.05)
            world.storages["s0:1"].crash()
            world.network.heal("s1:1")
            world.network.heal("s2:1")
            with pytest.raises(QuorumLostError):
                await pending
            assert await partition.append(req(2)) == 1

    run_virtual(main())


def test_checkpoint_interval_forces_new_sessions() -> None:
    async def main() -> None:
        world = World(checkpoint_interval=3, max_batch_size=1)
        async with world.partition() as partition:
            for i in range(10):
                assert await partition.append(req(i)) == i
            assert [o.reason for o in partition.outcomes].count(EndReason.CHECKPOINT) >= 2
        lwms = [world.storages[n].session_info(0).low_water_mark for n in NAMES]
        assert min(lwms) >= 6  # clean points advanced with the forced sessions

    run_virtual(main())


def test_old_owner_is_fenced_and_stops_with_generation_mismatch() -> None:
    async def main() -> None:
        world = World()
        old = world.partition(generation=1)
        await old.start()
        assert await old.append(req(0, generation=1)) == 0
        async with world.partition(generation=2) as new:
            assert await new.append(req(1, generation=2)) == 1
            # The old owner's session is fenced on contact; its next session is refused by ZooKeeper.
            with pytest.raises(GenerationMismatchError):
                await old.append(req(2, generation=1))
            await _wait(lambda: not old.is_healthy)
            with pytest.raises(GenerationMismatchError):
                await old.append(req(3, generation=1))
            assert await new.append(req(4, generation=2)) == 2
        await old.close()
        for name in NAMES:
            assert all(r.req_id.generation == 2 for r in world.log(name)[1:])

    run_virtual(main())


def test_request_generation_must_match() -> None:
    async def main() -> None:
        world = World()
        async with world.partition(generation=3) as partition:
            with pytest.raises(GenerationMismatchError):
                await partition.append(req(0, generation=2))

    run_virtual(main())


def test_corrupt_append_is_refused_before_it_is_written() -> None:
    async def main() -> None:
        world = World()
        async with world.partition() as partition:
            bad = Req(ReqId.of(7, 1, 0, 0), 0, b"data", crc32(b"other"))
            with pytest.raises(CorruptionError):
                await partition.append(bad)

    run_virtual(main())


def test_closed_partition_refuses_appends_and_fails_pending_ones() -> None:
    async def main() -> None:
        world = World()
        partition = world.partition()
        await partition.start()
        for name in NAMES[1:]:
            world.storages[name].crash()
        pending = asyncio.ensure_future(partition.append(req(0)))
        await asyncio.sleep(0.5)
        await partition.close()
        with pytest.raises(ClosedResourceError):
            await pending
        with pytest.raises(ClosedResourceError):
            await partition.append(req(1))

    run_virtual(main())


def test_replica_set_change_moves_the_log_to_the_new_set() -> None:
    async def main() -> None:
        world = World([*NAMES, "s3:1", "s4:1"])
        async with world.partition() as partition:
            for i in range(5):
                await partition.append(req(i))
            partition.set_replicas(["s2:1", "s3:1", "s4:1"])
            for i in range(5, 10):
                assert await partition.append(req(i)) == i

            def all_joined() -> bool:
                session = partition.session
                return session is not None and len(session.participants) == 3

            await _wait(all_joined)
            await partition.flush()
            await _wait(lambda: all(len(world.log(n)) == 10 for n in ("s2:1", "s3:1", "s4:1")))
        metadata, _ = world.metadata.peek(0)
        assert sorted(metadata.replicas) == ["s2:1", "s3:1", "s4:1"]

    run_virtual(main())


def test_memory_storage_fences_on_arrival() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        storage = MemoryStorage("s:1", 1, network)
        connector = MemoryConnector(network)
        old = await connector.connect("s:1", 0, 1)
        new = await connector.connect("s:1", 0, 2)
        await old.append([Record.build(0, ReqId.of(1, 1, 0, 0), 0, b"x")])
        await new.last_session_info()
        with pytest.raises(SessionFencedError):
            await old.append([Record.build(1, ReqId.of(1, 1, 0, 1), 0, b"y")])
        assert storage.partitions[0].mutation_sessions == [1]

    run_virtual(main())


def test_backoff_doubles_up_to_the_maximum_on_the_injected_clock() -> None:
    async def main() -> None:
        clock = ManualClock()
        backoff = Backoff(clock, random.Random(0), initial_ms=100, maximum_ms=800)
        ceilings = []
        for _ in range(6):
            delay = backoff.next_delay_ms()
            ceilings.append(delay)
        assert all(50 <= d <= 100 for d in ceilings[:1])
        assert all(400 <= d <= 800 for d in ceilings[3:])
        backoff.reset()
        sleeper = asyncio.ensure_future(backoff.sleep())
        await asyncio.sleep(0)
        assert not sleeper.done()
        clock.advance(100)
        await asyncio.sleep(0)
        assert sleeper.done()

    asyncio.run(main())
