"""A server partition (one incarnation: one generation on one server) answers every request it cannot take.

The store under it is a small fake (this tests the partition alone): always open, flushes at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from waltz.errors import ClosedResourceError
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.feed_cache import FeedCache
from waltz.server.partition import Partition
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache
from waltz.testing.partition_store import RecordingPeer


class _Store:
    def __init__(self, generation: int, high_water_mark: int = -1) -> None:
        self.generation = generation
        self.high_water_mark = high_water_mark
        self.is_healthy = True
        self.submitted: list[ReqId] = []

    def submit(self, request: cs.AppendRequest, *_: object) -> bool:
        self.submitted.append(request.req_id)
        return True

    async def start(self) -> None:
        pass

    async def wait_open(self) -> int:
        return self.high_water_mark

    async def flush(self) -> int:
        return self.high_water_mark

    async def close(self) -> None:
        self.is_healthy = False


async def _mounted(generation: int, client_id: int = 7) -> tuple[Partition, RecordingPeer, ReqId]:
    part = Partition(
        0,
        cast(StorePartition, _Store(generation)),
        feed_cache=FeedCache(1 << 20, 1),
        transaction_cache=TransactionCache(1 << 20),
    )
    await part.start()
    peer = RecordingPeer()
    session = ReqId.of(client_id, generation, 0, -1)
    await part.mount(cast(Any, peer), cs.MountRequest(session, -1, 1))
    for _ in range(100):
        if any(isinstance(m, cs.MountResponse) for m in peer.sent):
            break
        await asyncio.sleep(0.01)
    assert peer.sent[-1] == cs.MountResponse(session, cs.PartitionState.READY)
    return part, peer, session


def test_a_flush_naming_an_append_of_an_earlier_generation_is_taken() -> None:
    # A client's flush names its last pending append, which may have been sent before the partition moved:
    # refusing it for its generation would send the client into a loop of mounts (found by the fault suite).
    async def main() -> None:
        part, peer, _ = await _mounted(generation=3)
        try:
            old_append = ReqId.of(7, 2, 0, 41)
            assert part.accepts_flush(cast(Any, peer), old_append)
            # An append must carry the partition's generation, though.
            assert not part.accepts(cast(Any, peer), old_append)
            assert part.accepts(cast(Any, peer), ReqId.of(7, 3, 0, 42))
            # Another connection of the client is not its current mount: neither is taken.
            assert not part.accepts_flush(cast(Any, RecordingPeer()), ReqId.of(7, 3, 0, 43))
        finally:
            await part.close()

    asyncio.run(main())


def test_closing_an_incarnation_tells_its_mounted_clients_to_mount_again() -> None:
    async def main() -> None:
        part, peer, session = await _mounted(generation=1)
        await part.close()
        assert peer.sent[-1] == cs.MountResponse(session, cs.PartitionState.NOT_READY)
        assert not part.accepts(cast(Any, peer), ReqId.of(7, 1, 0, 1))
        assert part.problem == "closed"

    asyncio.run(main())


def test_append_nowait_takes_only_appends_of_the_current_mount_in_this_generation() -> None:
    # append_nowait checks the mount on the ReqId's raw msb (client id << 32 | generation), kept in step with
    # the registrations: each case accepts() refuses must be refused there too, and nothing reach the store.
    async def main() -> None:
        for client_id in (7, -5):  # a negative client id: the msb's high half read unsigned
            part, peer, session = await _mounted(generation=3, client_id=client_id)
            store = cast(_Store, part.store)
            try:

                def append(generation: int, seq: int, client_id: int = client_id) -> cs.AppendRequest:
                    return cs.AppendRequest.build(ReqId.of(client_id, generation, 0, seq), -1, 0, b"x")

                assert part.append_nowait(cast(Any, peer), append(3, 1)) is True
                assert part.append_nowait(cast(Any, peer), append(2, 2)) is False  # an older generation
                assert part.append_nowait(cast(Any, peer), append(4, 3)) is False  # a newer one
                other = RecordingPeer()
                assert part.append_nowait(cast(Any, other), append(3, 4)) is False  # not its mount
                other_client = cs.AppendRequest.build(ReqId.of(client_id + 1, 3, 0, 5), -1, 0, b"x")
                assert part.append_nowait(cast(Any, peer), other_client) is False  # never mounted
                # A newer connection of the client mounts: the old one's appends are refused from then on.
                newer = RecordingPeer()
                await part.mount(cast(Any, newer), cs.MountRequest(session, -1, 2))
                assert part.append_nowait(cast(Any, peer), append(3, 6)) is False
                assert part.append_nowait(cast(Any, newer), append(3, 7)) is True
                part.disconnect(cast(Any, newer))
                assert part.append_nowait(cast(Any, newer), append(3, 8)) is False
                assert [r.seq_num for r in store.submitted] == [1, 7]
            finally:
                await part.close()
            assert part.append_nowait(cast(Any, peer), append(3, 9)) is False

    asyncio.run(main())


async def _incarnation(generation: int, high_water_mark: int) -> Partition:
    part = Partition(
        3,
        cast(StorePartition, _Store(generation, high_water_mark)),
        feed_cache=FeedCache(1 << 20, 4),
        transaction_cache=TransactionCache(1 << 20),
    )
    await part.start()
    await part.wait_ready()
    return part


async def _mount_answer(part: Partition, generation: int, client_high_water_mark: int) -> cs.PartitionState:
    """The answer to one mount (every answer but READY is sent before mount() returns)."""
    peer = RecordingPeer()
    session = ReqId.of(7, generation, 3, -1)
    async with asyncio.timeout(5):
        await part.mount(cast(Any, peer), cs.MountRequest(session, client_high_water_mark, 1))
    answers = [m for m in peer.sent if isinstance(m, cs.MountResponse)]
    assert len(answers) == 1, peer.sent
    assert answers[0].req_id == session
    return answers[0].state


def test_an_incarnation_of_an_older_generation_never_answers_a_newer_mount_client_ahead() -> None:
    # Issue 24: a returning owner reopened its partitions one at a time; meanwhile the old, fenced incarnation
    # of partition 3 (generation 3, at 457) answered a generation-5 mount of a client at 636 (applied under
    # the other owner) with CLIENT_AHEAD, which the client takes as final: it was stranded. Only the
    # incarnation of the generation a mount names may answer it.
    async def main() -> None:
        part = await _incarnation(generation=3, high_water_mark=457)
        try:
            assert await _mount_answer(part, 5, 636) == cs.PartitionState.NOT_READY
            assert await _mount_answer(part, 5, 100) == cs.PartitionState.NOT_READY  # not READY either
            assert await _mount_answer(part, 2, 100) == cs.PartitionState.NOT_READY
            # Its own generation is answered, and a client really ahead of it is told so.
            assert await _mount_answer(part, 3, 636) == cs.PartitionState.CLIENT_AHEAD
        finally:
            await part.close()

    asyncio.run(main())


def test_client_ahead_needs_an_open_store_session() -> None:
    # A session that ended (quorum lost, or fenced by a new owner) leaves the last mark this server knew,
    # which need not be the log's end: no CLIENT_AHEAD from it, only NOT_READY (the client mounts again).
    async def main() -> None:
        part = await _incarnation(generation=3, high_water_mark=457)
        try:
            cast(_Store, part.store).is_healthy = False
            assert await _mount_answer(part, 3, 636) == cs.PartitionState.NOT_READY
            cast(_Store, part.store).is_healthy = True
            assert await _mount_answer(part, 3, 636) == cs.PartitionState.CLIENT_AHEAD
        finally:
            await part.close()

    asyncio.run(main())


def test_a_closed_incarnation_answers_a_mount_not_ready_at_once() -> None:
    async def main() -> None:
        part = await _incarnation(generation=3, high_water_mark=457)
        await part.close()
        # Before, it registered the mount and flushed through the append task that close() had ended: the
        # mount was never answered.
        assert await _mount_answer(part, 3, 636) == cs.PartitionState.NOT_READY
        assert await _mount_answer(part, 3, 10) == cs.PartitionState.NOT_READY

    asyncio.run(main())


class _FencedStore(_Store):
    """A store fenced by a new owner while a flush waits (once ``fence_on_flush``): the flush returns with the
    appends it had in flight failed, and no session opens again until the store closes."""

    def __init__(self, generation: int, high_water_mark: int) -> None:
        super().__init__(generation, high_water_mark)
        self.fence_on_flush = False
        self.waiting_open = asyncio.Event()
        self._closed = asyncio.Event()

    async def flush(self) -> int:
        if self.fence_on_flush:
            self.is_healthy = False
        return self.high_water_mark

    async def wait_open(self) -> int:
        if not self.is_healthy:
            self.waiting_open.set()
            await self._closed.wait()
            raise ClosedResourceError("store closed")
        return self.high_water_mark

    async def close(self) -> None:
        self.is_healthy = False
        self._closed.set()


def test_a_flush_is_answered_only_through_an_open_store_session() -> None:
    # A fenced store fails the appends it had in flight (the new owner's recovery may have committed them) and
    # knows a mark behind the log's end: a FlushResponse from it would make the client fail those appends for
    # good. The flush waits instead, and closing the incarnation tells the client to mount again.
    async def main() -> None:
        store = _FencedStore(3, 457)
        part = Partition(
            3,
            cast(StorePartition, store),
            feed_cache=FeedCache(1 << 20, 4),
            transaction_cache=TransactionCache(1 << 20),
        )
        await part.start()
        peer = RecordingPeer()
        session = ReqId.of(7, 3, 3, -1)
        await part.mount(cast(Any, peer), cs.MountRequest(session, 457, 1))
        flush = cs.FlushRequest(ReqId.of(7, 3, 3, 12))
        async with asyncio.timeout(5):
            await part.flush_request(cast(Any, peer), flush)  # an open session: answered at once
        assert peer.sent[-1] == cs.FlushResponse(flush.req_id, 457)
        store.fence_on_flush = True
        task = asyncio.create_task(part.flush_request(cast(Any, peer), flush))
        async with asyncio.timeout(5):
            await store.waiting_open.wait()
        assert peer.sent[-1] == cs.FlushResponse(flush.req_id, 457)  # the first answer; nothing since
        await part.close()
        async with asyncio.timeout(5):
            await asyncio.gather(task, return_exceptions=True)
        assert peer.sent.count(cs.FlushResponse(flush.req_id, 457)) == 1
        assert peer.sent[-1] == cs.MountResponse(session, cs.PartitionState.NOT_READY)

    asyncio.run(main())
