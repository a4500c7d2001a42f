"""A partition's feed under requests that arrive while it waits: a second mount of one connection racing the
first, and a FeedRequest arriving while the feed task reads headers from the store. Each id is sent in order,
and exactly one feed task lives per mounted client.

The store and the connection are the fakes of ``test_server_partition_feed`` (this tests the partition
alone); the store here reads headers only when the test lets it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

from tests.unit.test_server_partition_feed import CLIENT, _append, _Peer, _settle, _Store
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.feed_cache import FeedCache
from waltz.server.partition import Partition
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache


def _session(seq: int) -> ReqId:
    """A mount session's ReqId (the client numbers them negative, as the network driver does)."""
    return ReqId.of(CLIENT, 1, 0, -seq)


def _feed_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("feed-") and not t.done()]


@contextlib.asynccontextmanager
async def _partition(store: _Store, min_fetch_size: int = 100) -> AsyncIterator[Partition]:
    part = Partition(
        0,
        cast(StorePartition, store),
        feed_cache=FeedCache(1 << 20, 1),
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
        async with _partition(_Store()) as part:
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
