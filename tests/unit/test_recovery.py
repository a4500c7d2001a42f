"""Recovery: replica classification, metadata updates, the shared vote state, whole recoveries in memory."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from waltz.cluster.partition_metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.protocol.records import Record, ReqId
from waltz.server.store.interfaces import SessionInfo
from waltz.server.store.recovery import (
    RecoveryState,
    ReplicaClass,
    classify_replica,
    metadata_after_recovery,
    metadata_with_clean_replica,
)
from waltz.server.store.store_partition import StorePartition
from waltz.testing import run_virtual
from waltz.testing.store import MemoryConnector, MemoryMetadataStore, MemoryNetwork, MemoryStorage

A, B, C, D = "a:1", "b:1", "c:1", "d:1"


def _md(session: int, **states: tuple[int, int]) -> PartitionMetadata:
    names = {"a": A, "b": B, "c": C, "d": D}
    return PartitionMetadata(
        1, session, {names[k]: ReplicaState(names[k], s, closing) for k, (s, closing) in states.items()}
    )


class TestClassify:
    def test_brand_new_partition(self) -> None:
        c = classify_replica(PartitionMetadata(), A, SessionInfo(-1, -1, -1), 5)
        assert c.kind is ReplicaClass.EMPTY
        assert not c.counted

    def test_new_replica_truncates_to_its_low_water_mark(self) -> None:
        c = classify_replica(_md(3, a=(3, UNRESOLVED)), B, SessionInfo(1, 7, 7), 12)
        assert (c.kind, c.truncate_to, c.counted) == (ReplicaClass.NEW, 7, False)

    def test_restored_replica_is_unknown_in_the_vote(self) -> None:
        c = classify_replica(_md(5, a=(4, UNRESOLVED)), A, SessionInfo(2, 9, 9), 30)
        assert (c.kind, c.truncate_to, c.counted) == (ReplicaClass.RESTORED, 9, False)

    def test_closed_replica_truncates_to_its_closing_mark(self) -> None:
        c = classify_replica(_md(5, a=(3, 40)), A, SessionInfo(3, 10, 10), 55)
        assert (c.kind, c.truncate_to, c.counted) == (ReplicaClass.CLOSED, 40, True)

    def test_never_clean_replica_is_cut_at_its_own_clean_point(self) -> None:
        c = classify_replica(_md(5, a=(-1, 40)), A, SessionInfo(2, 10, 10), 55)
        assert (c.kind, c.truncate_to, c.counted) == (ReplicaClass.UNTRUSTED, 10, True)

    def test_voting_and_behind(self) -> None:
        md = _md(5, a=(4, UNRESOLVED))
        voting = classify_replica(md, A, SessionInfo(4, 10, 10), 20)
        behind = classify_replica(md, A, SessionInfo(4, 10, 3), 8)
        assert (voting.kind, voting.truncate_to, voting.counted) == (ReplicaClass.VOTING, None, True)
        assert (behind.kind, behind.truncate_to, behind.counted) == (ReplicaClass.BEHIND, None, True)

    def test_a_damaged_replica_is_unknown_in_the_vote_and_keeps_what_it_holds(self) -> None:
        # Its node found records missing that its control file says it held (a wiped directory): its max id
        # says nothing about what it acknowledged, whatever ZooKeeper records for it.
        for md in (
            _md(5, a=(4, UNRESOLVED)),
            _md(5, a=(3, 40)),
            _md(5, a=(-1, 40)),
            _md(5, b=(4, UNRESOLVED)),
        ):
            c = classify_replica(md, A, SessionInfo(4, 10, 10, damaged=True), -1)
            assert (c.kind, c.truncate_to, c.counted) == (ReplicaClass.DAMAGED, None, False)

    def test_a_closed_replica_is_never_cut_below_its_own_low_water_mark(self) -> None:
        # A later session recovered it (its low-water mark 24) but ended before recording it clean: its
        # records up to 24 are committed, and its node refuses to cut them.
        c = classify_replica(_md(4, a=(0, -1)), A, SessionInfo(3, 24, -1), 19)
        assert (c.kind, c.truncate_to, c.counted) == (ReplicaClass.CLOSED, 24, True)

    def test_a_later_storage_session_still_votes(self) -> None:
        # The replica set its low-water mark in a recovery that never wrote ZooKeeper.
        c = classify_replica(_md(7, a=(4, UNRESOLVED)), A, SessionInfo(6, 10, 10), 10)
        assert c.kind is ReplicaClass.VOTING


class TestMetadata:
    def test_states_after_recovery(self) -> None:
        previous = _md(5, a=(4, UNRESOLVED), b=(4, UNRESOLVED), c=(2, 17))
        after = metadata_after_recovery(previous, 3, 6, [A, B, C, D], recovered=[A], resolved=30)
        assert after.generation == 3
        assert after.session_id == 6
        assert after.replicas == {
            A: ReplicaState(A, 6, UNRESOLVED),  # clean
            B: ReplicaState(B, 4, 30),  # active before, not recovered: closed at the resolved mark
            C: ReplicaState(C, 2, 17),  # already closed: unchanged
            D: ReplicaState(D, -1, 30),  # brand new, not recovered
        }

    def test_unassigned_replicas_are_dropped(self) -> None:
        previous = _md(5, a=(4, UNRESOLVED), b=(4, UNRESOLVED))
        after = metadata_after_recovery(previous, 1, 6, [A], recovered=[A], resolved=3)
        assert list(after.replicas) == [A]

    def test_late_replica_marked_clean(self) -> None:
        current = _md(6, a=(6, UNRESOLVED), b=(4, 30))
        assert metadata_with_clean_replica(current, B, 6).replicas[B] == ReplicaState(B, 6, UNRESOLVED)


class TestRecoveryState:
    def test_resolution_and_ushers(self) -> None:
        async def main() -> None:
            state = RecoveryState(_md(5, a=(4, UNRESOLVED), b=(4, UNRESOLVED), c=(4, UNRESOLVED)))
            state.update(A, 20)
            state.update(C, 10)
            assert state.resolved is None  # B (offline) might hold 20
            assert state.usher(C) == (A, 20)
            assert state.usher(A) is None
            state.update(C, 20)  # C caught up with A
            assert state.resolved == 20
            state.update(C, 25)
            assert state.resolved == 20  # once decided, never changes

        asyncio.run(main())

    def test_no_previous_replicas_resolves_at_once(self) -> None:
        assert RecoveryState(PartitionMetadata()).resolved == -1

    def test_only_previous_replicas_vote(self) -> None:
        async def main() -> None:
            with pytest.raises(ValueError):
                RecoveryState(_md(5, a=(4, UNRESOLVED))).update(B, 3)

        asyncio.run(main())


# -- whole recoveries against memory storages ---------------------------------------------------------------


def _records(start: int, end: int, tag: int) -> list[Record]:
    return [
        Record.build(i, ReqId.of(tag, 1, 0, i), tag, bytes([tag, i % 256])) for i in range(start, end + 1)
    ]


def _load(storage: MemoryStorage, records: Sequence[Record], info: SessionInfo) -> None:
    part = storage.partitions[0]
    part.records = list(records)
    part.synced = len(records)
    part.persisted_session_id = part.session_id = info.session_id
    part.low_water_mark = info.low_water_mark
    part.local_low_water_mark = info.local_low_water_mark


class World:
    def __init__(self, names: Sequence[str]) -> None:
        self.network = MemoryNetwork(random.Random(1), min_delay_ms=0.1, max_delay_ms=1.0)
        self.storages = {n: MemoryStorage(n, 1, self.network, rng=random.Random(2)) for n in names}
        self.metadata = MemoryMetadataStore()

    def partition(self, replicas: Sequence[str], generation: int = 1) -> StorePartition:
        return StorePartition(
            0,
            generation,
            replicas,
            connector=MemoryConnector(self.network),
            metadata_store=self.metadata,
            rng=random.Random(3),
        )

    def log(self, name: str) -> list[Record]:
        return self.storages[name].durable_records(0)


async def _recover(world: World, replicas: Sequence[str]) -> StorePartition:
    partition = world.partition(replicas)
    await partition.start()
    await partition.wait_open()
    return partition


def _setup_previous_session(world: World, md: PartitionMetadata) -> None:
    world.metadata._nodes[0] = (md.encode(0), 0)


def test_recovery_resolves_the_quorum_mark_and_truncates_dirty_tails() -> None:
    async def main() -> None:
        world = World([A, B, C])
        common = _records(0, 9, 1)
        _load(world.storages[A], common + _records(10, 14, 2), SessionInfo(4, 5, 5))  # H_A = 14
        _load(world.storages[B], common + _records(10, 19, 2), SessionInfo(4, 5, 5))  # H_B = 19
        _load(world.storages[C], common, SessionInfo(4, 5, 5))  # H_C = 9
        _setup_previous_session(world, _md(4, a=(4, UNRESOLVED), b=(4, UNRESOLVED), c=(4, UNRESOLVED)))
        partition = await _recover(world, [A, B, C])
        assert partition.high_water_mark == 14
        await partition.close()
        # Once every replica recovered, all hold exactly 0..14, with session 5's low-water mark.
        for name in (A, B, C):
            assert world.log(name) == common + _records(10, 14, 2), name

    run_virtual(main())


def test_recovery_waits_while_undecidable_and_decides_when_the_replica_returns() -> None:
    async def main() -> None:
        world = World([A, B, C])
        common = _records(0, 9, 1)
        _load(world.storages[A], common + _records(10, 14, 2), SessionInfo(4, 5, 5))
        _load(world.storages[B], common + _records(10, 19, 2), SessionInfo(4, 5, 5))
        _load(world.storages[C], common, SessionInfo(4, 5, 5))
        _setup_previous_session(world, _md(4, a=(4, UNRESOLVED), b=(4, UNRESOLVED), c=(4, UNRESOLVED)))
        world.storages[B].crash()
        partition = world.partition([A, B, C])
        await partition.start()
        await asyncio.sleep(5)
        # B might hold 14 with A: undecidable until C catches up with A (its usher), then 14 is decided.
        assert partition.high_water_mark == 14
        assert world.log(C) == common + _records(10, 14, 2)
        world.storages[B].restart()
        await asyncio.sleep(5)
        await partition.close()

    run_virtual(main())


def test_restored_replica_is_truncated_and_caught_up() -> None:
    async def main() -> None:
        world = World([A, B, C])
        log = _records(0, 19, 1)
        _load(world.storages[A], log, SessionInfo(6, 15, 15))
        _load(world.storages[B], log, SessionInfo(6, 15, 15))
        # C restored from an old backup: older session, an old tail that was never committed past 7.
        _load(world.storages[C], _records(0, 7, 1) + _records(8, 12, 9), SessionInfo(3, 7, 7))
        _setup_previous_session(world, _md(6, a=(6, UNRESOLVED), b=(6, UNRESOLVED), c=(6, UNRESOLVED)))
        partition = await _recover(world, [A, B, C])
        assert partition.high_water_mark == 19
        while world.log(C) != log:  # noqa: ASYNC110 - polls storage state on virtual time
            await asyncio.sleep(0.01)
        await partition.close()

    run_virtual(main())


def test_added_replica_is_brought_up_to_date_and_recorded_clean() -> None:
    async def main() -> None:
        world = World([A, B, C, D])
        log = _records(0, 29, 1)
        for name in (A, B, C):
            _load(world.storages[name], log, SessionInfo(2, 29, 29))
        _setup_previous_session(world, _md(2, a=(2, UNRESOLVED), b=(2, UNRESOLVED), c=(2, UNRESOLVED)))
        partition = await _recover(world, [A, B, C, D])
        while True:
            session = partition.session
            if session is not None and len(session.participants) == 4:
                break
            await asyncio.sleep(0.01)
        assert world.log(D) == log
        metadata, _ = world.metadata.peek(0)
        assert metadata.replicas[D] == ReplicaState(D, metadata.session_id, UNRESOLVED)
        await partition.close()

    run_virtual(main())


def test_removed_replicas_still_vote_until_the_session_opens() -> None:
    async def main() -> None:
        world = World([A, B, C, D])
        common = _records(0, 9, 1)
        # The tail 10..14 was committed on C and D only (2 of the previous 4 replicas + A = quorum of 3).
        _load(world.storages[A], common + _records(10, 14, 2), SessionInfo(4, 9, 9))
        _load(world.storages[B], common, SessionInfo(4, 9, 9))
        _load(world.storages[C], common + _records(10, 14, 2), SessionInfo(4, 9, 9))
        _load(world.storages[D], common + _records(10, 14, 2), SessionInfo(4, 9, 9))
        previous = _md(4, a=(4, UNRESOLVED), b=(4, UNRESOLVED), c=(4, UNRESOLVED), d=(4, UNRESOLVED))
        _setup_previous_session(world, previous)
        partition = await _recover(world, [A, B])  # C and D removed
        assert partition.high_water_mark == 14
        metadata, _ = world.metadata.peek(0)
        assert sorted(metadata.replicas) == [A, B]
        await partition.close()

    run_virtual(main())
