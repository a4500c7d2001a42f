"""Server caches: the feed cache (header blocks), the transaction data cache and its coalescing fetcher."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz.errors import ClosedResourceError, StorageRpcError
from waltz.protocol.records import RecordHeader, ReqId
from waltz.server.feed_cache import BLOCK_BYTES, BLOCK_ENTRIES, FeedCache
from waltz.server.transaction_cache import (
    ENTRY_OVERHEAD_BYTES,
    TransactionCache,
    TransactionData,
    TransactionFetcher,
)


def header(txn: int, partition: int = 0) -> RecordHeader:
    return RecordHeader(txn, ReqId.of(7, 1, partition, txn + 1), txn * 3 - 1)


# -- feed cache


def test_feed_cache_get_returns_what_was_added() -> None:
    cache = FeedCache(max_bytes=100 * BLOCK_BYTES, num_partitions=2)
    for txn in range(130):
        cache.add(0, header(txn))
    assert cache.get(0, 0) == header(0)
    assert cache.get(0, 129) == header(129)
    assert cache.get(0, 130) is None  # never added
    assert cache.get(1, 5) is None  # another partition
    stats = cache.statistics()
    assert (stats.hits, stats.misses) == (2, 2)
    assert stats.blocks == 3  # ids 0..63, 64..127, 128..129


def test_feed_cache_extreme_field_values_round_trip() -> None:
    cache = FeedCache()
    odd = RecordHeader(2**63 - 1, ReqId(2**64 - 1, 0), -(2**31))
    cache.add(3, odd)
    assert cache.get(3, 2**63 - 1) == odd


def test_feed_cache_get_range_stops_at_the_first_gap() -> None:
    cache = FeedCache()
    cache.fill(0, [header(t) for t in range(60, 70)])  # crosses a block boundary at 64
    cache.add(0, header(71))
    assert cache.get_range(0, 60, 100) == [header(t) for t in range(60, 70)]
    assert cache.get_range(0, 62, 3) == [header(62), header(63), header(64)]
    assert cache.get_range(0, 70, 5) == []
    assert cache.get_range(0, 200, 5) == []
    stats = cache.statistics()
    assert stats.hits == 13
    assert stats.misses == 3


def test_feed_cache_total_blocks_are_bounded() -> None:
    cache = FeedCache(max_bytes=10 * BLOCK_BYTES, num_partitions=4)
    assert cache.max_blocks == 10
    assert cache.local_max_blocks == 2  # 10 // (4 + 1)
    for partition in range(4):
        for txn in range(0, 50 * BLOCK_ENTRIES, BLOCK_ENTRIES):
            cache.add(partition, header(txn, partition))
            assert cache.statistics().blocks <= 10
    assert cache.statistics().evictions == 4 * 50 - 10


def test_feed_cache_scan_of_one_partition_keeps_others_local_blocks() -> None:
    cache = FeedCache(max_bytes=12 * BLOCK_BYTES, num_partitions=2)  # local LRU: 4 blocks each
    for txn in (0, 64):
        cache.add(1, header(txn, 1))  # partition 1's hot blocks
    for txn in range(0, 40 * BLOCK_ENTRIES, BLOCK_ENTRIES):
        cache.add(0, header(txn))  # partition 0 scans a long catch-up range
    # Partition 1's blocks stayed in its local LRU; partition 0 only churned its own blocks and the pool.
    assert cache.get(1, 0) == header(0, 1)
    assert cache.get(1, 64) == header(64, 1)


def test_feed_cache_local_lru_order_and_pool_promotion() -> None:
    cache = FeedCache(max_bytes=6 * BLOCK_BYTES, num_partitions=2)  # local LRU: 2 blocks, total 6
    for block in range(3):
        cache.add(0, header(block * BLOCK_ENTRIES))
    # Block 0 was pushed to the shared pool; a hit brings it back (pushing block 1 out instead).
    assert cache.statistics().pool_blocks == 1
    assert cache.get(0, 0) == header(0)
    assert cache.statistics().pool_blocks == 1
    # Fill the cache with other blocks: the pool evicts its oldest first, i.e. block 1, not block 0.
    for block in range(3, 7):
        cache.add(0, header(block * BLOCK_ENTRIES))
    assert cache.get(0, 64) is None


def test_feed_cache_evict_partition() -> None:
    cache = FeedCache(max_bytes=6 * BLOCK_BYTES, num_partitions=2)
    for block in range(4):
        cache.add(0, header(block * BLOCK_ENTRIES))
    cache.add(1, header(0, 1))
    cache.evict_partition(0)
    assert cache.statistics().blocks == 1
    assert cache.statistics().pool_blocks == 0
    assert cache.get(0, 0) is None
    assert cache.get(1, 0) == header(0, 1)


def test_feed_cache_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="negative"):
        FeedCache().add(0, header(-1))
    with pytest.raises(ValueError, match="positive"):
        FeedCache(num_partitions=0)


@settings(max_examples=100)
@given(
    st.integers(1, 12),
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2000), st.booleans()), max_size=200),
)
def test_feed_cache_model(blocks: int, partitions: int, ops: list[tuple[int, int, bool]]) -> None:
    """Against a dict of everything ever added: a hit is always right, and the block bound always holds."""
    cache = FeedCache(max_bytes=blocks * BLOCK_BYTES, num_partitions=partitions)
    added: dict[tuple[int, int], RecordHeader] = {}
    for partition, txn, is_add in ops:
        if is_add:
            cache.add(partition, header(txn, partition))
            added[(partition, txn)] = header(txn, partition)
            assert cache.get(partition, txn) == header(txn, partition)  # just added: always cached
        else:
            got = cache.get(partition, txn)
            assert got is None or got == added[(partition, txn)]
        stats = cache.statistics()
        assert stats.blocks <= cache.max_blocks


# -- transaction cache


def test_transaction_cache_hit_miss_and_stats() -> None:
    cache = TransactionCache(max_bytes=10_000)
    assert cache.put(0, 1, b"abc", 0x352441C2)
    assert cache.get(0, 1) == TransactionData(b"abc", 0x352441C2)
    assert cache.get(0, 2) is None
    assert cache.get(1, 1) is None  # keys include the partition
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.entries) == (1, 2, 1)
    assert stats.size_bytes == 3 + ENTRY_OVERHEAD_BYTES


def test_transaction_cache_is_byte_bounded_with_lru_order() -> None:
    item = 300
    cost = item + ENTRY_OVERHEAD_BYTES
    cache = TransactionCache(max_bytes=4 * cost)
    for txn in range(4):
        cache.put(0, txn, bytes(item), 0)
    assert cache.size_bytes == 4 * cost
    cache.get(0, 0)  # 0 becomes the most recently used, so 1 is now the least
    cache.put(0, 4, bytes(item), 0)
    assert cache.get(0, 1) is None
    assert [t for t in range(5) if (0, t) in cache] == [0, 2, 3, 4]
    assert cache.size_bytes <= cache.max_bytes
    assert cache.statistics().evictions == 1


def test_transaction_cache_refuses_items_over_a_quarter_of_capacity() -> None:
    cache = TransactionCache(max_bytes=4000)
    assert not cache.put(0, 1, bytes(1000 - ENTRY_OVERHEAD_BYTES + 1), 0)
    assert cache.get(0, 1) is None
    assert cache.put(0, 2, bytes(1000 - ENTRY_OVERHEAD_BYTES), 0)
    assert cache.statistics().rejected_too_large == 1


def test_transaction_cache_replacing_an_entry_keeps_the_size_right() -> None:
    cache = TransactionCache(max_bytes=10_000)
    cache.put(0, 1, bytes(100), 0)
    cache.put(0, 1, bytes(10), 0)
    assert cache.size_bytes == 10 + ENTRY_OVERHEAD_BYTES
    cache.evict_partition(0)
    assert cache.size_bytes == 0
    assert len(cache) == 0


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 1500)), max_size=100))
def test_transaction_cache_never_exceeds_its_bound(puts: list[tuple[int, int]]) -> None:
    cache = TransactionCache(max_bytes=5000)
    for txn, size in puts:
        cache.put(0, txn, bytes(size), 0)
        assert cache.size_bytes <= cache.max_bytes
        assert cache.size_bytes == sum(len(v.data) + ENTRY_OVERHEAD_BYTES for v in cache._entries.values())


# -- transaction fetcher


class FakeStore:
    """A loader whose reads block until the test releases them, counting calls per key."""

    def __init__(self) -> None:
        self.calls: dict[tuple[int, int], int] = {}
        self.gate = asyncio.Event()
        self.fail: BaseException | None = None
        self.running = 0
        self.max_running = 0

    async def load(self, partition: int, txn: int) -> TransactionData:
        self.calls[(partition, txn)] = self.calls.get((partition, txn), 0) + 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.gate.wait()
        finally:
            self.running -= 1
        if self.fail is not None:
            raise self.fail
        data = f"p{partition}t{txn}".encode()
        return TransactionData(data, len(data))


def test_fetcher_coalesces_concurrent_fetches_of_one_key() -> None:
    async def main() -> None:
        store = FakeStore()
        fetcher = TransactionFetcher(TransactionCache(), store.load)
        waiters = [asyncio.create_task(fetcher.fetch(0, 5)) for _ in range(20)]
        await asyncio.sleep(0)
        assert fetcher.in_flight == 1
        store.gate.set()
        results = await asyncio.gather(*waiters)
        assert results == [TransactionData(b"p0t5", 4)] * 20
        assert store.calls == {(0, 5): 1}
        assert fetcher.coalesced == 19
        assert fetcher.in_flight == 0
        # Now cached: no further load.
        assert await fetcher.fetch(0, 5) == TransactionData(b"p0t5", 4)
        assert store.calls == {(0, 5): 1}

    asyncio.run(main())


def test_fetcher_failure_reaches_every_waiter_and_is_not_cached() -> None:
    async def main() -> None:
        store = FakeStore()
        store.fail = StorageRpcError("replica down")
        fetcher = TransactionFetcher(TransactionCache(), store.load)
        waiters = [asyncio.create_task(fetcher.fetch(1, 9)) for _ in range(5)]
        await asyncio.sleep(0)
        store.gate.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, StorageRpcError) for r in results)
        assert store.calls == {(1, 9): 1}
        assert (1, 9) not in fetcher.cache
        assert fetcher.in_flight == 0
        # The next fetch tries the store again, and succeeds now.
        store.fail = None
        assert await fetcher.fetch(1, 9) == TransactionData(b"p1t9", 4)
        assert store.calls == {(1, 9): 2}

    asyncio.run(main())


def test_fetcher_bounds_concurrent_loads() -> None:
    async def main() -> None:
        store = FakeStore()
        fetcher = TransactionFetcher(TransactionCache(), store.load, max_in_flight=3)
        waiters = [asyncio.create_task(fetcher.fetch(0, txn)) for txn in range(10)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert store.running == 3
        store.gate.set()
        await asyncio.gather(*waiters)
        assert store.max_running == 3
        assert len(store.calls) == 10

    asyncio.run(main())


def test_cancelling_one_waiter_does_not_cancel_the_shared_load() -> None:
    async def main() -> None:
        store = FakeStore()
        fetcher = TransactionFetcher(TransactionCache(), store.load)
        first = asyncio.create_task(fetcher.fetch(0, 1))
        second = asyncio.create_task(fetcher.fetch(0, 1))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        store.gate.set()
        assert await second == TransactionData(b"p0t1", 4)
        assert first.cancelled()
        assert store.calls == {(0, 1): 1}

    asyncio.run(main())


def test_failed_load_with_no_waiters_left_is_not_reported_as_unretrieved() -> None:
    async def main() -> None:
        store = FakeStore()
        store.fail = StorageRpcError("gone")
        fetcher = TransactionFetcher(TransactionCache(), store.load)
        only = asyncio.create_task(fetcher.fetch(0, 1))
        await asyncio.sleep(0)
        only.cancel()
        store.gate.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert fetcher.in_flight == 0

    loop_errors: list[dict[str, object]] = []

    async def guarded() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
        await main()

    asyncio.run(guarded())
    assert loop_errors == []


def test_put_serves_fresh_commits_without_a_load_and_aclose_cancels_loads() -> None:
    async def main() -> None:
        store = FakeStore()
        fetcher = TransactionFetcher(TransactionCache(), store.load)
        fetcher.put(0, 3, b"new", 3)
        assert await fetcher.fetch(0, 3) == TransactionData(b"new", 3)
        assert store.calls == {}
        pending = asyncio.create_task(fetcher.fetch(0, 4))
        await asyncio.sleep(0)
        await fetcher.aclose()
        with pytest.raises(asyncio.CancelledError):
            await pending
        with pytest.raises(ClosedResourceError):
            await fetcher.fetch(0, 5)
        assert await fetcher.fetch(0, 3) == TransactionData(b"new", 3)  # the cache still answers

    asyncio.run(main())


def test_add_entry_caches_what_add_caches_and_get_range_reads_runs_across_gaps_and_blocks() -> None:
    by_header, by_entry = FeedCache(1 << 20, 1), FeedCache(1 << 20, 1)
    present = [t for t in range(200) if t % 37 != 36 and t not in (64, 65)]
    for t in present:
        by_header.add(0, RecordHeader(t, ReqId(t * 3, 2**64 - 1 - t), -t))
        by_entry.add_entry(0, t, ReqId(t * 3, 2**64 - 1 - t), -t)
    with pytest.raises(ValueError):
        by_entry.add_entry(0, -1, ReqId(0, 0), 0)
    for start in range(0, 200, 7):
        for count in (1, 5, 64, 150):
            expected = []
            for t in range(start, start + count):
                if t not in present:
                    break
                expected.append(RecordHeader(t, ReqId(t * 3, 2**64 - 1 - t), -t))
            assert by_header.get_range(0, start, count) == expected
            assert by_entry.get_range(0, start, count) == expected
            assert by_entry.get_entries(0, start, count) == [
                (h.transaction_id, h.req_id.msb, h.req_id.lsb, h.header) for h in expected
            ]


@dataclass
class _Committed:
    """A committed append as the server's partition hands it to the caches (a store's pending append)."""

    transaction_id: int
    req_id: ReqId
    header: int
    data: bytes
    checksum: int


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 300),
    st.lists(st.integers(0, 70), min_size=1, max_size=6),
    st.integers(2, 6),
    st.integers(0, 600),
)
def test_a_batch_added_to_the_caches_in_one_call_caches_what_one_call_per_append_does(
    start: int, runs: list[int], blocks: int, data_bytes: int
) -> None:
    # Runs of consecutive ids (a committed batch each), crossing block boundaries, in caches small enough to
    # evict: add_run / put_run must leave each cache exactly as add_entry / put per append do.
    feed_one, feed_run = (FeedCache(max_bytes=blocks * BLOCK_BYTES, num_partitions=1) for _ in range(2))
    data_one, data_run = (TransactionCache(6 * (data_bytes + ENTRY_OVERHEAD_BYTES) + 1) for _ in range(2))
    txn = start
    for count in runs:
        batch = [
            _Committed(t, ReqId.of(-3, 1, 0, t), t * 7 - 3, bytes([t % 251]) * data_bytes, t * 11)
            for t in range(txn, txn + count)
        ]
        txn += count
        for c in batch:
            feed_one.add_entry(0, c.transaction_id, c.req_id, c.header)
            data_one.put(0, c.transaction_id, c.data, c.checksum)
        feed_run.add_run(0, batch)
        assert data_run.put_run(0, batch) == data_bytes * count  # every item's data, cached or not
        assert feed_run.statistics() == feed_one.statistics()
        assert feed_run.get_entries(0, start, txn - start) == feed_one.get_entries(0, start, txn - start)
        assert data_run.statistics() == data_one.statistics()
        assert list(data_run._entries.items()) == list(data_one._entries.items())
    with pytest.raises(ValueError, match="not negative"):
        feed_run.add_run(0, [_Committed(-1, ReqId(0, 0), 0, b"", 0)])
