"""StorePartition and StoreSession against memory storages: appends, reads, sessions, fencing, backoff, and
several batches in flight committing in order."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.errors import (
    ClosedResourceError,
    CorruptionError,
    GenerationMismatchError,
    PartitionNotReadyError,
    QuorumLostError,
    SessionFencedError,
)
from waltz.protocol.records import Record, ReqId, crc32
from waltz.server.store import EndReason, StoreConfig, StoreSession
from waltz.server.store.appends import FUTURES, AppendQueue, PendingAppend
from waltz.server.store.store_partition import StorePartition
from waltz.server.store.support import Backoff, InvariantViolation
from waltz.testing import run_virtual
from waltz.testing.store import (
    MemoryConnection,
    MemoryConnector,
    MemoryMetadataStore,
    MemoryNetwork,
    MemoryStorage,
)

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


def submit_now(partition: StorePartition, request: Req, more: bool = False) -> asyncio.Future[int] | None:
    """Submit ``request`` without waiting (``more``: as ``StorePartition.submit``'s): the future of its id,
    or None (nothing queued) if the queue is full."""
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    return future if partition.submit(request, FUTURES, future, more=more) else None


async def submit(partition: StorePartition, request: Req) -> asyncio.Future[int]:
    """Submit ``request``, waiting for room in the queue: the future of its id."""
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    while not partition.submit(request, FUTURES, future):
        await partition.wait_room()
    return future


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


def test_a_lone_append_is_batched_in_the_call_that_queued_it_and_its_burst_follows_one_iteration_later() -> (
    None
):
    async def main() -> None:
        world = World()
        async with world.partition() as partition:
            session = await _open_session(partition)
            await asyncio.sleep(0)  # the writer waits for appends
            first = submit_now(partition, req(0))
            # No loop iteration in between: the idle writer's batch was formed and delivered by the call.
            assert [b.first for b in session.batches_in_flight] == [0]
            assert partition.queue.qsize() == 0
            # Queued with it, in the same iteration (a burst read in one go): the writer, woken by the
            # first arrival, sends them one iteration later as the next batch, without waiting for the
            # commit of the first (as it sent a whole burst before the lone append's shortcut).
            burst = [submit_now(partition, req(i)) for i in (1, 2)]
            assert [b.first for b in session.batches_in_flight] == [0]
            assert partition.queue.qsize() == 2
            await asyncio.sleep(0)
            assert [b.first for b in session.batches_in_flight] == [0, 1]
            assert partition.queue.qsize() == 0
            # Later arrivals while batches are in flight wait for a commit (not a full batch: no 3rd batch).
            later = [submit_now(partition, req(i)) for i in (3, 4)]
            await asyncio.sleep(0)
            assert [b.first for b in session.batches_in_flight] == [0, 1]
            assert first is not None
            assert await first == 0
            assert [await f for f in burst + later if f is not None] == [1, 2, 3, 4]
            assert [r.transaction_id for r in world.log(NAMES[0])] == [0, 1, 2, 3, 4]

    run_virtual(main())


def test_lone_appends_after_a_commit_leave_in_the_call_and_the_parked_writer_is_not_woken() -> None:
    async def main() -> None:
        world = World()
        async with world.partition() as partition:
            session = await _open_session(partition)
            for i in range(3):
                done = submit_now(partition, req(i))
                assert [b.first for b in session.batches_in_flight] == [i]
                # The writer, parked idle by the last decision, is where it would wait with this batch in
                # flight: nothing wakes it (one task wake-up per lone append fewer).
                assert not session._wake.is_set()
                assert done is not None
                assert await done == i
                assert session.batches_in_flight == ()
            # While batches are in flight, a full batch still wakes it, and it sends that batch.
            first = submit_now(partition, req(3))
            rest = [submit_now(partition, req(i)) for i in range(4, 4 + session.full_count)]
            assert session._wake.is_set()
            await asyncio.sleep(0)
            assert [b.first for b in session.batches_in_flight] == [3, 4]
            end = 4 + session.full_count
            assert [await f for f in [first, *rest] if f is not None] == list(range(3, end))
            # Parked idle again, an append that promises more that never come (the rest of the read was for
            # other partitions): a callback of the next loop pass sends it; the writer is not woken.
            assert session.batches_in_flight == ()
            future = submit_now(partition, req(end), more=True)
            assert future is not None
            assert session.batches_in_flight == ()
            await asyncio.sleep(0)
            assert [b.first for b in session.batches_in_flight] == [end]
            assert not session._wake.is_set()
            assert await asyncio.wait_for(future, 5) == end
            # The host that knows the burst ended (its read's last request was another partition's) says so:
            # the appends leave in that call.
            futures = [submit_now(partition, req(i), more=True) for i in (end + 1, end + 2)]
            assert None not in futures
            assert session.batches_in_flight == ()
            partition.end_burst()
            assert [(b.first, b.last) for b in session.batches_in_flight] == [(end + 1, end + 2)]
            assert [await f for f in futures if f is not None] == [end + 1, end + 2]
            assert [r.transaction_id for r in world.log(NAMES[0])] == list(range(end + 3))

    run_virtual(main())


def test_submit_refuses_when_the_queue_is_full_and_append_checks_the_checksum_that_submit_trusts() -> None:
    async def main() -> None:
        world = World(max_queued_appends=3)
        listener = _BatchListener()
        async with world.partition() as partition:
            await partition.wait_open()
            await asyncio.sleep(0)  # the writer waits for appends
            # The first leaves at once in a batch of its own (the writer was idle); the next three wait in
            # the queue for that batch to be decided, and fill it.
            futures = [submit_now(partition, req(i)) for i in range(4)]
            assert all(f is not None for f in futures)
            assert submit_now(partition, req(4)) is None  # full: nothing queued
            assert [await f for f in futures if f is not None] == [0, 1, 2, 3]
            # submit trusts the caller's checksum check (the server's codec verifies as it decodes); append
            # checks it itself.
            bad = Req(ReqId.of(7, 1, 0, 9), 0, b"data", crc32(b"other"))
            with pytest.raises(CorruptionError):
                await partition.append(bad)
            # A listener that raises is logged; the store carries on, and the appends after it are heard.
            failing = _BatchListener()
            failing.appends_committed = lambda _appends: 1 / 0  # type: ignore[assignment,method-assign]
            assert partition.submit(req(4), failing, "lost")
            assert partition.submit(req(5), listener, "heard")
            assert await partition.flush() == 5
            assert listener.calls == [[(5, "heard")]]
            assert await partition.append(req(6)) == 6
            # A failed append is heard once, with its error.
            for name in NAMES[1:]:
                world.storages[name].crash()
            doomed = submit_now(partition, req(7))
            assert doomed is not None
            await asyncio.sleep(0.5)
        assert doomed.done()
        assert isinstance(doomed.exception(), ClosedResourceError)

    run_virtual(main())


class _BatchListener:
    """Records every call of the AppendListener interface."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, object]]] = []
        self.failed: list[tuple[object, BaseException]] = []

    def appends_committed(self, appends: Sequence[PendingAppend]) -> None:
        self.calls.append([(p.transaction_id, p.tag) for p in appends])

    def append_failed(self, append: PendingAppend, error: BaseException) -> None:
        self.failed.append((append.tag, error))


def test_submit_tells_its_listener_once_per_batch_in_order_and_each_append_once() -> None:
    async def main() -> None:
        world = World(max_queued_appends=7)
        listener = _BatchListener()
        other = _BatchListener()
        async with world.partition() as partition:
            with pytest.raises(GenerationMismatchError):
                partition.submit(req(0, generation=2), listener, "refused", 0.0)
            await partition.wait_open()
            await asyncio.sleep(0)  # the writer waits for appends: the first leaves at once, in a batch
            # A lone append is a batch of its own; the seven behind it wait for its commit and form one more
            # batch, with an append of another listener among them: each listener hears its runs of the batch,
            # in id order.
            assert partition.submit(req(0), listener, "a0", 1.5)
            for i in range(1, 7):
                if i == 4:
                    assert partition.submit(req(i), other, "b4")
                else:
                    assert partition.submit(req(i), listener, f"a{i}", 0.0)
            assert partition.submit(req(7), listener, "a7", 0.0)
            assert not partition.submit(req(8), listener, "full", 0.0)  # full: nothing queued
            assert await partition.flush() == 7
            assert listener.calls == [
                [(0, "a0")],
                [(1, "a1"), (2, "a2"), (3, "a3")],
                [(5, "a5"), (6, "a6"), (7, "a7")],
            ]
            assert other.calls == [[(4, "b4")]]
            assert not listener.failed
            # An append that will never commit is told to append_failed, once, with its tag.
            for name in NAMES[1:]:
                world.storages[name].crash()
            assert partition.submit(req(8), listener, "doomed", 0.0)
            await asyncio.sleep(0.5)
        assert [(tag, type(error)) for tag, error in listener.failed] == [("doomed", ClosedResourceError)]
        assert len(listener.calls) == 3

    run_virtual(main())


def test_appends_submitted_with_more_to_follow_leave_with_the_last_of_them_as_one_batch() -> None:
    async def main() -> None:
        world = World(max_batch_size=4, max_queued_appends=8)
        listener = _BatchListener()
        async with world.partition() as partition:
            session = await _open_session(partition)
            await asyncio.sleep(0)  # the writer waits for appends
            # A burst read in one go: the idle writer sends nothing while more follow, then all of it with
            # the last one, in that call.
            for i in range(3):
                assert partition.submit(req(i), listener, i, 0.0, more=True)
            assert session.batches_in_flight == ()
            assert partition.submit(req(3), listener, 3, 0.0)
            assert [(b.first, b.last) for b in session.batches_in_flight] == [(0, 3)]
            assert await partition.flush() == 3
            await asyncio.sleep(0)  # idle again
            # A full batch leaves at once even while more follow.
            for i in range(4, 8):
                assert partition.submit(req(i), listener, i, 0.0, more=True)
            assert [(b.first, b.last) for b in session.batches_in_flight] == [(4, 7)]
            # A caller that promised more and sent none: the writer sends what it left one iteration later.
            assert partition.submit(req(8), listener, 8, 0.0, more=True)
            assert partition.queue.qsize() == 1
            assert await partition.flush() == 8
            assert listener.calls == [[(i, i) for i in range(4)], [(i, i) for i in range(4, 8)], [(8, 8)]]
        assert not listener.failed

    run_virtual(main())


def test_committed_batches_are_counted_by_size() -> None:
    async def main() -> None:
        world = World()
        listener = _BatchListener()
        async with world.partition() as partition:
            await partition.wait_open()
            await asyncio.sleep(0)
            for size in (1, 2, 3, 8, 9, 40):
                for i in range(size):
                    partition.submit(req(i), listener, i, 0.0, more=i < size - 1)
                await partition.flush()
                await asyncio.sleep(0)
            stats = partition.stats
            # Buckets: <= 1, 2, 4, 8, 16, 32, 64, 128, 256, above.
            assert stats.batch_appends_counts == [1, 1, 1, 1, 1, 0, 1, 0, 0, 0]
            assert stats.batch_appends_sum == 63

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


def test_backoff_doubles_up_to_the_maximum_on_the_loops_clock() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(random.Random(0), initial_ms=100, maximum_ms=800)
        ceilings = []
        for _ in range(6):
            delay = backoff.next_delay_ms()
            ceilings.append(delay)
        assert all(50 <= d <= 100 for d in ceilings[:1])
        assert all(400 <= d <= 800 for d in ceilings[3:])
        backoff.reset()
        started = loop.time()
        await backoff.sleep()
        # Virtual time: the first delay after a reset is drawn from [50, 100] ms, and nothing else runs.
        assert 0.05 <= loop.time() - started <= 0.1

    run_virtual(main())


# -- several batches in flight -------------------------------------------------------------------------------


class RecordingPartition(StorePartition):
    """Records the high-water mark of every ``batch_committed`` call, in call order."""

    commits: list[int]

    def batch_committed(self, session: StoreSession, appends: Sequence[PendingAppend]) -> None:
        self.commits.append(session.high_water_mark)
        super().batch_committed(session, appends)


def _recording_partition(world: World) -> RecordingPartition:
    partition = RecordingPartition(
        0,
        1,
        NAMES,
        connector=MemoryConnector(world.network),
        metadata_store=world.metadata,
        config=world.config,
    )
    partition.commits = []
    return partition


def _slow_fsyncs(world: World, fsync_ms: float) -> None:
    for storage in world.storages.values():
        storage.fsync_ms = (fsync_ms, fsync_ms)


async def _open_session(partition: StorePartition) -> StoreSession:
    await partition.wait_open()
    session = partition.session
    assert session is not None
    return session


def test_a_later_batch_with_its_quorum_waits_for_the_earlier_ones() -> None:
    async def main() -> None:
        world = World(max_batch_size=1, max_inflight_batches=4)
        async with _recording_partition(world) as partition:
            session = await _open_session(partition)
            _slow_fsyncs(world, 500)
            first = await submit(partition, req(0))
            second = await submit(partition, req(1))
            await _wait(lambda: len(session.batches_in_flight) == 2)
            later = session.batches_in_flight[1]
            # Batch 2 reaches its quorum (2 of 3) while batch 1 has no vote yet.
            later.voting.vote()
            later.voting.vote()
            assert later.voting.outcome is True
            assert session.high_water_mark == partition.high_water_mark == -1
            assert partition.commits == []
            assert not second.done()
            # Batch 1's real acknowledgements commit it, then batch 2, in that order.
            assert await first == 0
            assert second.done()
            assert await second == 1
            assert partition.commits == [0, 1]
            assert session.high_water_mark == 1
            assert session.batches_in_flight == ()

    run_virtual(main())


@pytest.mark.parametrize("max_inflight", [1, 3])
def test_at_most_max_inflight_batches_are_sent(max_inflight: int) -> None:
    async def main() -> None:
        world = World(max_batch_size=1, max_inflight_batches=max_inflight, max_queued_appends=20)
        async with _recording_partition(world) as partition:
            session = await _open_session(partition)
            _slow_fsyncs(world, 200)
            futures = [await submit(partition, req(i)) for i in range(10)]
            await _wait(lambda: len(session.batches_in_flight) == max_inflight)
            await asyncio.sleep(0.1)  # half an fsync: nothing is acknowledged, nothing more may be sent
            assert [b.first for b in session.batches_in_flight] == list(range(max_inflight))
            assert session.next_id == max_inflight
            assert partition.queue.qsize() == 10 - max_inflight
            assert [await f for f in futures] == list(range(10))
            assert partition.commits == list(range(10))

    run_virtual(main())


def test_with_a_batch_in_flight_only_a_full_batch_is_sent_before_the_next_commit() -> None:
    async def main() -> None:
        world = World(max_batch_size=3, max_inflight_batches=4)
        async with _recording_partition(world) as partition:
            session = await _open_session(partition)
            _slow_fsyncs(world, 200)
            futures = [await submit(partition, req(0))]
            await _wait(lambda: len(session.batches_in_flight) == 1)
            await asyncio.sleep(0.01)  # later than req(0): not in its burst (which would follow it at once)
            futures += [await submit(partition, req(i)) for i in (1, 2)]
            await asyncio.sleep(0.1)  # half an fsync: two queued appends are not a full batch
            assert len(session.batches_in_flight) == 1
            futures.append(await submit(partition, req(3)))
            await _wait(lambda: len(session.batches_in_flight) == 2)
            assert [(b.first, b.last) for b in session.batches_in_flight] == [(0, 0), (1, 3)]
            assert [await f for f in futures] == [0, 1, 2, 3]
            assert partition.commits == [0, 3]

    run_virtual(main())


def test_request_end_waits_for_every_batch_in_flight_and_sends_no_more() -> None:
    async def main() -> None:
        world = World(max_batch_size=1, max_inflight_batches=4)
        async with _recording_partition(world) as partition:
            session = await _open_session(partition)
            _slow_fsyncs(world, 100)
            futures = [await submit(partition, req(i)) for i in range(3)]
            await _wait(lambda: len(session.batches_in_flight) == 3)
            partition.request_new_session()
            late = await submit(partition, req(3))
            assert not session.ended
            # Every batch in flight commits in this session; the late append waits for the next one.
            assert [await f for f in futures] == [0, 1, 2]
            await _wait(lambda: bool(partition.outcomes))
            assert session.next_id == 3
            assert partition.outcomes[-1].reason is EndReason.CHECKPOINT
            assert await late == 3
            assert partition.session is not session

    run_virtual(main())


def test_a_failed_session_leaves_several_batches_to_the_next_recovery() -> None:
    async def main() -> None:
        world = World(max_batch_size=1, max_inflight_batches=6)
        async with _recording_partition(world) as partition:
            session = await _open_session(partition)
            _slow_fsyncs(world, 100)
            futures = []
            for i in range(6):
                futures.append(await submit(partition, req(i)))
                # Sent before the next is queued, so each is a request of its own (one fsync each).
                await _wait(lambda n=i + 1: len(session.batches_in_flight) == n)
            await _wait(lambda: partition.high_water_mark == 1)
            # Two of three replicas crash while fsyncing id 2, each keeping a random prefix of it: the session
            # fails with four batches in flight, and the next session's recovery decides their fate.
            assert [b.first for b in session.batches_in_flight] == [2, 3, 4, 5]
            world.storages["s1:1"].crash()
            world.storages["s2:1"].crash()
            await _wait(lambda: session.ended)
            world.storages["s1:1"].restart()
            world.storages["s2:1"].restart()
            results = await asyncio.gather(*futures, return_exceptions=True)
            assert partition.commits == [0, 1]
            committed = [r for r in results if isinstance(r, int)]
            # The ones the vote kept succeed with the id they were given, the rest are definitely lost.
            assert committed in ([0, 1], [0, 1, 2])
            assert all(isinstance(r, QuorumLostError) for r in results[len(committed) :])
            await partition.flush()
            assert partition.high_water_mark == len(committed) - 1
            for name in NAMES:
                await _wait(lambda n=name: len(world.log(n)) == len(committed))
                assert [r.req_id for r in world.log(name)] == [req(i).req_id for i in range(len(committed))]

    run_virtual(main())


def test_a_late_replica_joins_with_the_batches_in_flight_and_votes_on_them() -> None:
    async def main() -> None:
        world = World(max_batch_size=2, max_inflight_batches=4)
        world.storages["s2:1"].crash()
        async with _recording_partition(world) as partition:
            session = await _open_session(partition)
            assert [p.storage for p in session.participants] == ["s0:1", "s1:1"]
            _slow_fsyncs(world, 20)

            async def load() -> None:
                for i in range(200):
                    await submit(partition, req(i))
                    await asyncio.sleep(0.002)

            loader = asyncio.ensure_future(load())
            await _wait(lambda: partition.high_water_mark >= 10)
            world.storages["s2:1"].restart()
            await _wait(lambda: len(session.participants) == 3)
            joined_with = session.batches_in_flight
            assert joined_with, "the load keeps batches in flight"
            assert all(b.voting.voters == 3 for b in joined_with)
            await loader
            await partition.flush()
            assert session.is_open  # the joiner kept up: nobody failed, nobody abstained
            assert all(b.voting.votes == 3 for b in joined_with)
            await _wait(lambda: all(len(world.log(n)) == 200 for n in NAMES))
            assert world.log("s2:1") == world.log("s1:1") == world.log("s0:1")

    run_virtual(main())


def test_an_append_failed_while_its_producer_waited_for_room_is_never_written() -> None:
    async def main() -> None:
        world = World(max_batch_size=1, max_queued_appends=1)
        old = world.partition(generation=1)
        await old.start()
        assert await old.append(req(0)) == 0
        for name in NAMES:
            world.network.isolate(name)
        in_flight = asyncio.ensure_future(old.append(req(1)))
        await _wait(lambda: old.queue.empty() and old.statistics()["inflight_appends"] == 1)
        queued = asyncio.ensure_future(old.append(req(2)))
        waiting = asyncio.ensure_future(old.append(req(3)))  # the queue is full: waits for room
        await asyncio.sleep(0.01)
        assert old.queue.full()
        assert not waiting.done()
        for name in NAMES:
            world.network.heal(name)
        # A newer owner takes the partition: the old one fails everything it holds, and the producer still
        # waiting for room is refused when it offers its append again.
        async with world.partition(generation=2) as new:
            assert await new.append(req(4, generation=2)) == 1
            for future in (in_flight, queued, waiting):
                with pytest.raises(GenerationMismatchError):
                    await future
        # The old server owns the partition again: the failed append must not be written now.
        old.set_generation(3)
        assert await old.append(req(5, generation=3)) == 2
        await _wait(lambda: all(len(world.log(n)) == 3 for n in NAMES))
        await old.close()
        for name in NAMES:
            written = [r.req_id for r in world.log(name)]
            assert written == [req(0).req_id, req(4, generation=2).req_id, req(5, generation=3).req_id]

    run_virtual(main())


def test_metadata_generation_no_assignment_explains_is_reported_not_obeyed_silently() -> None:
    async def main() -> None:
        world = World(stale_report_ms=5_000)
        # An anonymous write left the partition's metadata at generation 1002; the assignment says 3.
        await world.metadata.compare_and_set(0, PartitionMetadata(generation=1002, session_id=4), -1)
        async with world.partition(generation=3) as partition:
            await _wait(lambda: not partition.is_healthy and partition.statistics()["metadata_conflict"])
            conflict = str(partition.statistics()["metadata_conflict"])
            assert "generation 1002" in conflict
            assert "not written by an owner the assignment named" in conflict
            with pytest.raises(GenerationMismatchError):
                await partition.append(req(0, generation=3))
            # An operator reassigns it above the bogus generation: the report clears and appends commit.
            partition.set_generation(1003)
            assert await partition.append(req(1, generation=1003)) == 0
            assert partition.statistics()["metadata_conflict"] is None

    run_virtual(main())


def test_metadata_repaired_by_an_operator_is_served_again_without_a_new_assignment() -> None:
    async def main() -> None:
        world = World(stale_report_ms=5_000)
        await world.metadata.compare_and_set(0, PartitionMetadata(generation=3, session_id=-1), -1)
        async with world.partition(generation=3) as partition:
            assert await partition.append(req(0, generation=3)) == 0
            # A bogus write of generation 1002 (the rest kept); a replica fails, so a new session is needed.
            metadata, version = await world.metadata.get(0)
            bogus = PartitionMetadata(1002, metadata.session_id, metadata.replicas)
            version = await world.metadata.compare_and_set(0, bogus, version)
            world.storages["s0:1"].crash()
            await _wait(lambda: partition.statistics()["metadata_conflict"] is not None)
            # The operator's fix (waltz cluster fix-generation) lowers it back to the assigned generation.
            fixed = PartitionMetadata(3, bogus.session_id, bogus.replicas)
            await world.metadata.compare_and_set(0, fixed, version)
            world.storages["s0:1"].restart()
            await _wait(lambda: partition.statistics()["metadata_conflict"] is None, timeout_s=15)
            assert await partition.append(req(1, generation=3)) == 1
            records = await partition.read_records(0, 10)
            assert [r.req_id for r in records] == [req(0, generation=3).req_id, req(1, generation=3).req_id]

    run_virtual(main())


# -- damage reported by a replica's scrub --------------------------------------------------------------------


def test_damage_a_replica_reports_on_its_own_is_repaired_without_any_read() -> None:
    async def main() -> None:
        world = World(damage_poll_interval_ms=1_000)
        async with world.partition() as partition:
            ids = await asyncio.gather(*(partition.append(req(i)) for i in range(20)))
            assert ids == list(range(20))
            bad = world.storages["s1:1"]
            for txn in (3, 4, 11):
                bad.damage(0, txn)
            # Nobody reads: the owner's poll finds the damage and sends good copies.
            await _wait(lambda: not bad.partitions[0].damaged, timeout_s=5)
            repairs = partition.repairs
            assert (repairs.started, repairs.finished, repairs.failed, repairs.records) == (1, 1, 0, 3)
            assert (repairs.in_progress, repairs.failing) == ({}, {})
            assert partition.damaged_replicas == {}  # no read met it
            assert await partition.append(req(20)) == 20  # writes went on
            assert partition.is_healthy

    run_virtual(main())


def test_damage_no_other_replica_holds_a_good_copy_of_is_retried_later_not_every_poll() -> None:
    async def main() -> None:
        world = World(damage_poll_interval_ms=1_000)
        async with world.partition() as partition:
            await asyncio.gather(*(partition.append(req(i)) for i in range(10)))
            for name in NAMES:
                world.storages[name].damage(0, 5)
            await asyncio.sleep(3.5)
            # Every replica tried once, each failing: each then waits REPAIR_RETRY_POLLS polls.
            assert partition.repairs.started == 3
            assert partition.repairs.failed == 3
            assert partition.repairs.finished == 0
            # /health shows which replicas' repairs fail, and why, until they succeed.
            failing = partition.repairs.failing
            assert sorted(failing) == sorted(NAMES)
            assert all(why.startswith("5: CorruptionError") for why in failing.values()), failing
            assert partition.repairs.health()["failing"] == failing
            assert partition.repairs.in_progress == {}
            assert partition.is_healthy
            assert await partition.append(req(10)) == 10
            # One copy becomes good again (as a read's repair would make it): the other two are repaired from
            # it at their next try, and nothing is reported failing any more.
            world.storages[NAMES[0]].partitions[0].damaged.clear()
            await _wait(lambda: not partition.repairs.failing, timeout_s=30)
            assert partition.repairs.finished == 2
            assert all(not world.storages[name].partitions[0].damaged for name in NAMES)

    run_virtual(main())


def test_damage_polls_are_off_with_a_zero_interval() -> None:
    async def main() -> None:
        world = World(damage_poll_interval_ms=0)
        async with world.partition() as partition:
            await asyncio.gather(*(partition.append(req(i)) for i in range(10)))
            world.storages["s0:1"].damage(0, 2)
            await asyncio.sleep(30)
            assert world.storages["s0:1"].partitions[0].damaged == {2}
            assert partition.repairs.started == 0

    run_virtual(main())


def test_an_append_request_a_replica_never_answers_fails_it_at_its_own_deadline() -> None:
    """One timer per replica bounds its append requests: a request sent while an earlier one's deadline is
    armed still times out ``rpc_timeout_ms`` after it was sent (not at the earlier deadline, not never)."""

    async def main() -> None:
        world = World(max_batch_size=1, rpc_timeout_ms=2000)
        async with world.partition() as partition:
            session = await _open_session(partition)
            loop = asyncio.get_running_loop()
            assert await partition.append(req(0)) == 0  # arms s2's timer for about 2 s from now
            await asyncio.sleep(1.5)
            world.storages["s2:1"].fsync_ms = (600_000, 600_000)  # s2 stops answering appends
            sent = loop.time()
            assert await partition.append(req(1)) == 1  # s0 and s1 are a quorum
            await _wait(lambda: session.ended)
            assert 2.0 <= loop.time() - sent < 2.1
            outcome = partition.outcomes[0]
            assert outcome.reason is EndReason.REPLICA_FAILED
            assert "s2:1" in outcome.detail
            assert "timed out after 2000 ms" in outcome.detail

    run_virtual(main())


def test_a_replica_whose_connection_broke_before_a_batch_was_sent_fails_alone() -> None:
    """The connection refuses the send at once (it knows it is broken): that replica fails and the session
    ends for it, as when the request fails later; the writer and the other replicas carry on."""

    async def main() -> None:
        world = World(max_batch_size=1)
        async with world.partition() as partition:
            session = await _open_session(partition)
            assert await partition.append(req(0)) == 0
            connection = session.replica_sessions["s2:1"].connection
            assert connection is not None
            connection.break_()  # type: ignore[attr-defined]  # a MemoryConnection
            assert await partition.append(req(1)) == 1  # s0 and s1 are a quorum
            await _wait(lambda: session.ended)
            outcome = partition.outcomes[0]
            assert outcome.reason is EndReason.REPLICA_FAILED, outcome
            assert "s2:1" in outcome.detail
            assert await partition.append(req(2)) == 2  # the next session serves

    run_virtual(main())


def test_a_replica_answering_a_later_append_request_before_an_earlier_one_fails() -> None:
    """A node answers one connection's requests in order, so an acknowledgement vouches for every earlier
    append of the session: an answer that overtakes an older request's is a broken invariant. It is not
    voted for, nor logged and forgotten: it ends the session as a bug, counted, and the next session
    serves."""

    async def main() -> None:
        world = World(max_batch_size=1)
        async with world.partition() as partition:
            session = await _open_session(partition)
            assert await partition.append(req(0)) == 0
            replica = session.replica_sessions["s2:1"]
            connection = replica.connection
            assert connection is not None
            send = connection.start_append
            held: list[tuple[Callable[[asyncio.Future[object]], None], asyncio.Future[object]]] = []

            def start_append(
                records: Sequence[Record], on_answer: Callable[[asyncio.Future[object]], None]
            ) -> asyncio.Future[object]:
                def answered(future: asyncio.Future[object]) -> None:
                    if not held and records[0].transaction_id == 1:
                        held.append((on_answer, future))  # the older answer waits for the younger one
                        return
                    on_answer(future)
                    for later, older in held:
                        later(older)

                return send(records, answered)

            connection.start_append = start_append  # type: ignore[method-assign]
            first, second = submit_now(partition, req(1)), submit_now(partition, req(2))
            assert first is not None
            assert second is not None
            assert await first == 1  # s0 and s1 are a quorum
            assert await second == 2
            await _wait(lambda: partition.internal_errors)
            (error,) = partition.internal_errors
            assert isinstance(error, InvariantViolation)
            assert "s2:1 answered an append request before the one from 1" in str(error)
            assert session.ended
            assert await partition.append(req(3)) == 3  # the next session serves

    run_virtual(main())


def test_append_queue_offer_queues_while_there_is_room_and_says_how_many_are_queued() -> None:
    async def main() -> None:
        queue = AppendQueue(2)
        appends = [
            PendingAppend(r.req_id, r.header, r.data, r.checksum, FUTURES, i)
            for i, r in enumerate(map(req, range(3)))
        ]
        getter = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        assert queue.offer(appends[0]) == 1
        assert await getter is appends[0]  # the append that ended the emptiness woke the getter
        assert queue.offer(appends[1]) == 1
        assert queue.offer(appends[2]) == 2
        assert queue.data_bytes == len(appends[1].data) + len(appends[2].data)
        assert queue.offer(appends[0]) == 0  # full: nothing queued
        assert queue.qsize() == 2

    run_virtual(main())


def test_an_append_acknowledged_while_an_idle_probe_was_answered_is_not_an_invariant_violation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The idle probe asks a replica for its max id; a batch delivered while the probe is under way is sent at
    once, and over TCP its acknowledgement can be handled (in the read callback, raising the replica session's
    ``max_id``) before the probe's coroutine resumes with the answer of the same read. The replica answered
    what it held when asked, which is neither a lost nor an extra record: the session must go on, not end with
    "holds N, expected N+1"."""
    answered = asyncio.Event()
    acknowledged = asyncio.Event()
    armed = False
    probe = MemoryConnection.max_transaction_id

    async def probe_overtaken_by_an_acknowledgement(self: MemoryConnection) -> int:
        result = await probe(self)
        if armed and self.storage == "s0:1":
            answered.set()
            await acknowledged.wait()  # the append's acknowledgement is handled first, as in one TCP read
        return result

    monkeypatch.setattr(MemoryConnection, "max_transaction_id", probe_overtaken_by_an_acknowledgement)

    async def main() -> None:
        nonlocal armed
        world = World(idle_probe_interval_ms=20)
        async with world.partition() as partition:
            session = await _open_session(partition)
            assert await partition.append(req(0)) == 0
            replica = session.replica_sessions["s0:1"]
            await _wait(lambda: replica.max_id == 0)
            armed = True
            await answered.wait()  # s0 answered the probe with 0
            armed = False
            assert await partition.append(req(1)) == 1
            await _wait(lambda: replica.max_id == 1)
            acknowledged.set()
            await asyncio.sleep(0.1)  # the probe resumes, and later probes run
            assert not session.ended, partition.outcomes
            assert partition.outcomes == []
            assert await partition.append(req(2)) == 2

    run_virtual(main())


@pytest.mark.parametrize("change", ["lost", "extra"])
def test_the_idle_probe_still_fails_a_replica_that_lost_or_gained_a_record(change: str) -> None:
    """The other side of the tolerance above: with nothing delivered meanwhile, the range the probe accepts
    is one id, so a replica that lost its last record (or holds one the session never sent it) behind the
    session's back is caught at the next probe, not left counting as a healthy participant."""

    async def main() -> None:
        world = World(idle_probe_interval_ms=20)
        async with world.partition() as partition:
            session = await _open_session(partition)
            assert await partition.append(req(0)) == 0
            assert await partition.append(req(1)) == 1
            replica = session.replica_sessions["s0:1"]
            await _wait(lambda: replica.max_id == 1)
            records = world.storages["s0:1"].partitions[0].records
            if change == "lost":
                records.pop()
            else:
                records.append(records[-1])
            # An invariant broken is a bug or lost storage: the session fails (counted, logged) and a new one
            # starts from what the replicas really hold.
            await _wait(lambda: bool(partition.internal_errors))
            assert session.ended
            held = 0 if change == "lost" else 2
            assert [str(e) for e in partition.internal_errors] == [f"s0:1 holds {held}, expected 1"]

    run_virtual(main())


def test_a_failed_supervisor_fails_what_it_holds_refuses_more_and_tells_its_owner() -> None:
    async def main() -> None:
        world = World(max_batch_size=1, max_queued_appends=4)
        heard: list[BaseException] = []
        async with world.partition() as partition:
            partition.on_failure = heard.append
            assert await partition.append(req(0)) == 0

            async def broken() -> StoreSession:
                raise RuntimeError("injected supervisor bug")

            partition._new_session = broken  # type: ignore[method-assign]
            for name in NAMES:
                world.network.isolate(name)
            in_flight = submit_now(partition, req(1))
            queued = submit_now(partition, req(2))
            partition.request_new_session()
            await _wait(lambda: bool(heard))
            assert "injected supervisor bug" in repr(heard[0])
            assert partition.failure is heard[0]
            assert not partition.is_healthy
            for future in (in_flight, queued):
                assert future is not None
                with pytest.raises(PartitionNotReadyError):
                    await future
            with pytest.raises(PartitionNotReadyError):
                partition.submit(req(3), FUTURES, None)
            assert await partition.flush() == 0

    run_virtual(main())
