"""A committed batch reaches a live feed from the commit itself, and every other feed from its task, in id
order, each id once.

The store under the partition is a small fake (this tests the partition alone) that commits the appends it
was given in batches the test chooses, as the real store does (one ``appends_committed`` call per batch).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.feed_cache import FeedCache, FeedEntry
from waltz.server.partition import Partition
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache
from waltz.testing.partition_store import ManualStore

CLIENT = 7
SESSION = ReqId.of(CLIENT, 1, 0, -1)


class _Peer:
    """Records the FeedData ids and the other messages sent, in order."""

    def __init__(self) -> None:
        self.sent: list[cs.Message | int] = []
        self.closed = False
        self.drain_needed = False
        self.drains = 0

    def send(self, msg: cs.Message) -> None:
        self.sent.append(msg)

    def send_feed(self, entries: Sequence[FeedEntry], frames: dict[int, bytes] | None = None) -> None:
        self.sent.extend(txn for txn, *_ in entries)

    async def drain(self) -> None:
        self.drains += 1
        self.drain_needed = False

    def fed(self) -> list[int]:
        return [m for m in self.sent if isinstance(m, int)]


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def _live(min_fetch_size: int = 100) -> AsyncIterator[tuple[Partition, ManualStore, _Peer]]:
    """A started partition with one client mounted (READY) and a feed window open from id 0."""
    store = ManualStore()
    part = Partition(
        0,
        cast(StorePartition, store),
        feed_cache=FeedCache(1 << 20, 1),
        transaction_cache=TransactionCache(1 << 20),
        min_fetch_size=min_fetch_size,
    )
    await part.start()
    peer = _Peer()
    try:
        await part.mount(cast(Any, peer), cs.MountRequest(SESSION, -1, 1))
        await _settle()
        assert peer.sent == [cs.MountResponse(SESSION, cs.PartitionState.READY)]
        peer.sent.clear()
        assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, -1))
        await _settle()
        yield part, store, peer
    finally:
        await part.close()


def _append(part: Partition, peer: _Peer, count: int, first_seq: int = 0) -> None:
    for seq in range(first_seq, first_seq + count):
        msg = cs.decode_append_fields(
            cs.encode(cs.AppendRequest.build(ReqId.of(CLIENT, 1, 0, seq), -1, 0, b"x"), 2), 2
        )
        assert part.append_nowait(cast(Any, peer), msg)


def test_a_live_feed_gets_a_committed_batch_from_the_commit_without_its_task() -> None:
    async def main() -> None:
        async with _live() as (part, store, peer):
            _append(part, peer, 5)
            store.commit(5)
            # Sent inside the commit: no loop pass ran since.
            assert peer.fed() == [0, 1, 2, 3, 4]
            _append(part, peer, 3, first_seq=5)
            store.commit(2)
            store.commit(1)
            assert peer.fed() == list(range(8))
            await _settle()
            assert peer.fed() == list(range(8))  # the task sends nothing a second time

    asyncio.run(main())


def test_a_window_too_small_for_the_batch_leaves_it_to_the_task_which_suspends_the_feed() -> None:
    async def main() -> None:
        async with _live(min_fetch_size=4) as (part, store, peer):
            _append(part, peer, 6)
            store.commit(3)
            assert peer.fed() == [0, 1, 2]  # within the window of 4: from the commit
            store.commit(3)
            assert peer.fed() == [0, 1, 2]  # 3 more do not fit in the one id left
            await _settle()
            assert peer.sent == [0, 1, 2, 3, cs.FeedSuspended(SESSION)]
            # The client opens the next window from what it has: the rest comes, then live again.
            assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, 3))
            await _settle()
            assert peer.fed() == list(range(6))
            _append(part, peer, 2, first_seq=6)
            store.commit(2)
            assert peer.fed() == list(range(8))

    asyncio.run(main())


def test_a_batch_that_fills_the_window_is_followed_by_feed_suspended() -> None:
    async def main() -> None:
        async with _live(min_fetch_size=4) as (part, store, peer):
            _append(part, peer, 4)
            store.commit(4)
            assert peer.sent == [0, 1, 2, 3, cs.FeedSuspended(SESSION)]
            await _settle()
            assert peer.sent == [0, 1, 2, 3, cs.FeedSuspended(SESSION)]

    asyncio.run(main())


def test_a_backlogged_connection_gets_the_batch_from_the_task_after_a_drain() -> None:
    async def main() -> None:
        async with _live() as (part, store, peer):
            _append(part, peer, 6)
            store.commit(2)
            peer.drain_needed = True
            drains = peer.drains
            store.commit(2)
            assert peer.fed() == [0, 1]  # not written while the connection is backlogged
            await _settle()
            assert peer.fed() == [0, 1, 2, 3]
            assert peer.drains > drains  # the task drained after sending them
            store.commit(2)
            assert peer.fed() == list(range(6))

    asyncio.run(main())


def test_a_batch_with_an_append_resolved_on_its_own_goes_through_the_task_in_order() -> None:
    async def main() -> None:
        async with _live() as (part, store, peer):
            _append(part, peer, 5)
            store.commit(5, skip=0)
            # Id 0 alone, then 1..4: each part is dense and continues the feed.
            assert peer.fed() == [0, 1, 2, 3, 4]
            _append(part, peer, 5, first_seq=5)
            before = list(peer.fed())
            store.commit(5, skip=2)  # ids 5, 6, 8, 9 with a gap at 7 (its own call came first)
            assert peer.fed() == before  # id 7 alone does not continue the feed; the rest has a gap
            await _settle()
            assert peer.fed() == list(range(10))

    asyncio.run(main())


def test_an_append_that_waited_for_room_in_the_store_reaches_the_feed_from_its_commit() -> None:
    async def main() -> None:
        async with _live() as (part, store, peer):
            _append(part, peer, 2)
            # The next append goes through the append task (the store's queue refuses it as full), which
            # offers it again once there is room: one path to the store, one way to hear of its commit.
            store.full = True
            _append(part, peer, 1, first_seq=2)
            await _settle()
            assert len(store.pending) == 2
            store.make_room()
            await _settle()
            assert len(store.pending) == 3
            # Both batches commit in one loop iteration (e.g. two answers read in one data callback): each
            # goes to the feed from its commit.
            store.commit(2)
            store.commit(1)
            assert peer.fed() == [0, 1, 2]

    asyncio.run(main())


def test_a_feed_task_that_fails_of_a_bug_fails_the_partition_and_its_owner_hears_of_it() -> None:
    async def broken(_ctx: object) -> None:
        raise RuntimeError("injected feed bug")

    async def main() -> None:
        part = Partition(
            0,
            cast(StorePartition, ManualStore()),
            feed_cache=FeedCache(1 << 20, 1),
            transaction_cache=TransactionCache(1 << 20),
        )
        heard: list[Partition] = []
        part.on_failure = heard.append
        part._feed_loop = broken  # type: ignore[method-assign,assignment]
        await part.start()
        peer = _Peer()
        try:
            await part.mount(cast(Any, peer), cs.MountRequest(SESSION, -1, 1))
            await _settle()
            assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, -1))
            await _settle()
            assert heard == [part]
            assert part.problem is not None
            assert "injected feed bug" in part.problem
            assert not part.is_healthy
        finally:
            await part.close()

    asyncio.run(main())
