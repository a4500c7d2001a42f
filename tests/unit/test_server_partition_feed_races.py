"""A partition's feed under requests that arrive while it waits: a second mount of one connection racing the
first, a FeedRequest arriving while the feed task reads headers from the store, and a store read that fails.
Each id is sent in order, and exactly one feed task lives per mounted client.

The store and the connection are the fakes of ``test_server_partition_feed`` (this tests the partition
alone); the store here reads headers only when the test lets it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

from tests.unit.test_server_partition_feed import CLIENT, _append, _Peer, _settle
from waltz.client.stream import INBOX_FEED_LIMIT
from waltz.errors import PartitionNotReadyError
from waltz.protocol import client_server as cs
from waltz.protocol.records import RecordHeader, ReqId
from waltz.server.feed_cache import FeedCache
from waltz.server.partition import FEED_READ_RETRY_S, Partition
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache
from waltz.testing.partition_store import ManualStore


def _session(seq: int) -> ReqId:
    """A mount session's ReqId (the client numbers them negative, as the network driver does)."""
    return ReqId.of(CLIENT, 1, 0, -seq)


def _feed_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("feed-") and not t.done()]


@contextlib.asynccontextmanager
async def _partition(
    store: ManualStore, min_fetch_size: int = 100, cache: FeedCache | None = None
) -> AsyncIterator[Partition]:
    part = Partition(
        0,
        cast(StorePartition, store),
        feed_cache=cache if cache is not None else FeedCache(1 << 20, 1),
        transaction_cache=TransactionCache(1 << 20),
        min_fetch_size=min_fetch_size,
    )
    await part.start()
    try:
        yield part
    finally:
        await part.close()


def test_a_second_mount_on_one_connection_racing_the_first_leaves_one_feed_task() -> None:
    async def main() -> None:
        async with _partition(ManualStore()) as part:
            peer = _Peer()
            first, second = _session(1), _session(2)
            # Both wait for the append queue to drain (the flush) at once: the second arrives before the
            # first started its feed.
            await asyncio.gather(
                part.mount(cast(Any, peer), cs.MountRequest(first, -1, 1)),
                part.mount(cast(Any, peer), cs.MountRequest(second, -1, 1)),
            )
            await _settle()
            assert len(_feed_tasks()) == 1
            assert part.feed_context_count == 1
            # The superseded mount is told it is over; the latest one is served.
            assert peer.sent == [
                cs.MountResponse(first, cs.PartitionState.NOT_READY),
                cs.MountResponse(second, cs.PartitionState.READY),
            ]
            assert part.feed_request(cast(Any, peer), cs.FeedRequest(second, -1))
            assert not part.feed_request(cast(Any, peer), cs.FeedRequest(first, -1))
            peer.sent.clear()
            _append(part, peer, 3)
            await _settle()
            assert peer.sent == []  # appended, not committed yet
        # Closing the partition ended every feed task: none was left parked.
        assert _feed_tasks() == []

    asyncio.run(main())


class _SlowStore(ManualStore):
    """Keeps the committed headers and serves ``read_headers`` from them, but only once the test opens
    ``gate`` (``reading`` says a read waits there)."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[RecordHeader] = []  # index = transaction id
        self.gate = asyncio.Event()
        self.reading = asyncio.Event()

    def commit(self, count: int, *, skip: int | None = None) -> None:
        for i, pending in enumerate(self.pending[:count]):
            self.headers.append(RecordHeader(self.high_water_mark + 1 + i, pending.req_id, pending.header))
        super().commit(count, skip=skip)

    async def read_headers(self, transaction_id: int, max_count: int) -> list[Any]:
        self.reading.set()
        await self.gate.wait()
        return self.headers[transaction_id : transaction_id + max_count]


SESSION = _session(1)


@contextlib.asynccontextmanager
async def _reading_from_the_store() -> AsyncIterator[tuple[Partition, _SlowStore, _Peer]]:
    """Ten commits, ids 0..3 fed in a first window of 4, the feed cache emptied, and the client's next
    window (from 3) open: the feed task now waits in a store read of ids 4..9."""
    store = _SlowStore()
    cache = FeedCache(1 << 20, 1)
    async with _partition(store, min_fetch_size=4, cache=cache) as part:
        peer = _Peer()
        await part.mount(cast(Any, peer), cs.MountRequest(SESSION, -1, 1))
        await _settle()
        assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, -1))
        _append(part, peer, 10)
        store.commit(10)
        await _settle()
        assert peer.fed() == [0, 1, 2, 3]
        assert peer.sent[-1] == cs.FeedSuspended(SESSION)
        cache.evict_partition(0)
        assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, 3))
        async with asyncio.timeout(5):
            await store.reading.wait()
        yield part, store, peer


def test_a_feed_request_during_a_store_read_restarts_the_feed_where_it_asks() -> None:
    async def main() -> None:
        async with _reading_from_the_store() as (part, store, peer):
            # The client (re)opens its window from 5 while the read of 4..9 is under way.
            assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, 5))
            sent = len(peer.fed())
            store.gate.set()
            await _settle()
            assert peer.fed()[sent:] == [6, 7, 8, 9]
            assert peer.sent[-1] == cs.FeedSuspended(SESSION)  # that window (4) is used up
            assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, 9))
            _append(part, peer, 2, first_seq=10)
            store.commit(2)
            await _settle()
            assert peer.fed()[sent:] == [6, 7, 8, 9, 10, 11]

    asyncio.run(main())


def test_a_store_read_overtaken_by_commits_sent_live_is_not_sent_after_them() -> None:
    async def main() -> None:
        async with _reading_from_the_store() as (part, store, peer):
            # The client has everything (it says so), and new commits go to it from the commit itself
            # while the old read still waits: the read's entries must not follow them.
            assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, 9))
            sent = len(peer.fed())
            _append(part, peer, 2, first_seq=10)
            store.commit(2)
            assert peer.fed()[sent:] == [10, 11]
            store.gate.set()
            await _settle()
            assert peer.fed()[sent:] == [10, 11]
            _append(part, peer, 2, first_seq=12)
            store.commit(2)
            await _settle()
            assert peer.fed()[sent:] == [10, 11, 12, 13]

    asyncio.run(main())


def test_a_window_is_at_most_feed_window_max_however_far_behind_the_client_is() -> None:
    async def main() -> None:
        store = ManualStore()
        async with _partition(store, min_fetch_size=4) as part:
            peer = _Peer()
            await part.mount(cast(Any, peer), cs.MountRequest(SESSION, -1, 1))
            await _settle()
            total = cs.FEED_WINDOW_MAX + 500
            _append(part, peer, total)
            store.commit(total)
            # The client is `total` behind: one window brings FEED_WINDOW_MAX of them, then it must ask again
            # (its inbox holds one window; beyond that its connection, and every partition on it, would stop).
            assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, -1))
            await _settle()
            assert peer.fed() == list(range(cs.FEED_WINDOW_MAX))
            assert peer.sent[-1] == cs.FeedSuspended(SESSION)
            assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, cs.FEED_WINDOW_MAX - 1))
            await _settle()
            assert peer.fed() == list(range(total))

    asyncio.run(main())


def test_the_client_buffers_a_whole_window_without_stopping_its_connection() -> None:
    assert INBOX_FEED_LIMIT > cs.FEED_WINDOW_MAX


class _FailingStore(_SlowStore):
    """:class:`_SlowStore` whose reads fail (the store's own retries exhausted: storage unreachable for a
    while) until ``healthy`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate.set()
        self.failed = asyncio.Event()
        self.healthy = False

    async def read_headers(self, transaction_id: int, max_count: int) -> list[Any]:
        if not self.healthy:
            self.failed.set()
            raise PartitionNotReadyError("partition 0 has no open store session")
        return await super().read_headers(transaction_id, max_count)


def test_a_store_read_that_fails_is_tried_again_not_the_end_of_the_feed() -> None:
    """Nothing else would restart the feed: the client waits for the rest of its window (or a FeedSuspended)
    on a connection that stays open, and a reader that does not append never times out."""

    async def main() -> None:
        store = _FailingStore()
        cache = FeedCache(1 << 20, 1)
        async with _partition(store, min_fetch_size=4, cache=cache) as part:
            peer = _Peer()
            await part.mount(cast(Any, peer), cs.MountRequest(SESSION, -1, 1))
            await _settle()
            _append(part, peer, 6)
            store.commit(6)
            cache.evict_partition(0)  # the reader is behind the feed cache: its window comes from the store
            assert part.feed_request(cast(Any, peer), cs.FeedRequest(SESSION, -1))
            async with asyncio.timeout(5):
                await store.failed.wait()
            await _settle()
            assert peer.fed() == []
            store.healthy = True
            # The feed's pause began before this one, so it ends first (the loop's timers keep their order).
            await asyncio.sleep(FEED_READ_RETRY_S + 0.05)
            await _settle()
            assert peer.fed() == [0, 1, 2, 3, 4, 5]  # the window: the client's lag
            assert peer.sent[-1] == cs.FeedSuspended(SESSION)
            assert part.feed_context_count == 1

    asyncio.run(main())
