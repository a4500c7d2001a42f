"""The readahead window of transaction data: doubling on sequential misses, one record otherwise, each kept
record taken once, at most one window kept per partition."""

from __future__ import annotations

import asyncio

from waltz import AsyncWaltzClient
from waltz.client.readahead import READAHEAD_MAX, Readahead
from waltz.protocol.records import Record, ReqId
from waltz.testing import MockCluster, MockDriver

from .helpers import FAST, Ctx, RecordingCallbacks


def records(start: int, count: int) -> list[Record]:
    return [Record.build(t, ReqId(0, 0), 0, str(t).encode()) for t in range(start, start + count)]


def test_sequential_misses_double_the_window_up_to_the_cap_and_kept_records_are_taken_once() -> None:
    ahead = Readahead()
    assert ahead.window(0, 0) == 1  # A first miss: the single data request.
    ahead.keep(0, records(0, 1))
    assert ahead.window(0, 1) == 2
    ahead.keep(0, records(1, 2))
    assert ahead.take(0, 2) == b"2"
    assert ahead.take(0, 2) is None  # Taken once.
    assert ahead.take(0, 1) is None  # The first record of a read went to its caller, not kept.
    sizes = []
    start = 3
    for _ in range(12):
        window = ahead.window(0, start)
        sizes.append(window)
        ahead.keep(0, records(start, window))
        start += window
    assert sizes == [4, 8, 16, 32, 64, 128, 256, 512, 1024, 1024, 1024, 1024]
    assert READAHEAD_MAX == 1024


def test_a_short_read_continues_where_it_ended_and_a_jump_starts_again_at_one() -> None:
    ahead = Readahead()
    ahead.window(0, 10)
    ahead.keep(0, records(10, 1))
    assert ahead.window(0, 11) == 2
    ahead.keep(0, records(11, 1))  # The server returned fewer (the high-water mark).
    assert ahead.window(0, 12) == 4  # Still sequential: the next miss is where the read ended.
    ahead.keep(0, records(12, 4))
    assert ahead.window(0, 100) == 1  # A jump: back to single requests.
    assert ahead.take(0, 13) == b"13"  # Kept until the partition's next read replaces them.
    ahead.keep(0, records(100, 1))
    assert ahead.take(0, 14) is None  # Replaced: one window per partition at most.


def test_partitions_are_independent_and_forget_drops_a_partition() -> None:
    ahead = Readahead()
    ahead.window(0, 0)
    ahead.keep(0, records(0, 1))
    ahead.window(1, 5)
    ahead.keep(1, records(5, 1))
    assert ahead.window(0, 1) == 2
    ahead.keep(0, records(1, 2))
    assert ahead.window(1, 6) == 2
    ahead.keep(1, records(6, 2))
    assert ahead.take(1, 7) == b"7"
    assert ahead.take(0, 7) is None
    ahead.forget(0)
    assert ahead.take(0, 2) is None
    assert ahead.window(0, 3) == 1


class RangeReadingDriver(MockDriver):
    """A mock driver with the network driver's range reads, so the client keeps what it reads ahead."""

    def __init__(self, cluster: MockCluster) -> None:
        super().__init__(cluster=cluster)
        self.range_reads: list[tuple[int, int, int]] = []

    async def read_range(self, partition_id: int, start: int, max_count: int) -> list[Record]:
        self.range_reads.append((partition_id, start, max_count))
        return self.cluster.records(partition_id)[start : start + max_count]


def test_a_released_partition_and_a_closed_client_keep_no_readahead() -> None:
    """What a partition's reads kept (records, window, position) is dropped when set_partitions releases it
    and when the client closes, so it holds no memory and a later mount starts again at one record."""

    async def main() -> None:
        cluster = MockCluster(num_partitions=2)
        async with AsyncWaltzClient(RecordingCallbacks(), FAST, driver=MockDriver(cluster=cluster)) as writer:
            for i in range(40):
                await writer.submit(Ctx(str(i).encode(), partition=i % 2))
            await writer.flush_transactions(timeout=5)
        driver = RangeReadingDriver(cluster)
        callbacks = RecordingCallbacks()
        reader = AsyncWaltzClient(callbacks, FAST.replace(auto_mount=False), driver=driver)
        async with reader:
            await reader.set_partitions({0, 1})
            await reader.wait_applied(0, 19, timeout=5)
            await reader.wait_applied(1, 19, timeout=5)
            assert callbacks.data(0) == [str(i).encode() for i in range(0, 40, 2)]
            assert any(count > 1 for p, _, count in driver.range_reads if p == 0)  # It did read ahead.
            assert reader._readahead.holds(0)
            assert reader._readahead.holds(1)

            await reader.set_partitions({1})
            assert not reader._readahead.holds(0)
            assert reader._readahead.holds(1)
        assert not reader._readahead.holds(1)

    asyncio.run(main())
