"""FlushedIndexWrites: the index entries group fsyncs made due, written together a little later."""

from __future__ import annotations

import asyncio

from waltz.storage.index_writes import FlushedIndexWrites


class _Part:
    def __init__(self, partition_id: int) -> None:
        self.partition_id = partition_id
        self.written = 0

    def write_flushed_index(self) -> None:
        self.written += 1


def test_what_partitions_owe_is_written_once_each_after_the_delay() -> None:
    async def main() -> None:
        writes = FlushedIndexWrites(delay_s=0.01)
        a, b = _Part(0), _Part(1)
        for part in (a, b, a, a):  # three group fsyncs of a, one of b, in one interval
            writes.owe(part)
        await asyncio.sleep(0)
        assert (a.written, b.written, writes.owed) == (0, 0, 2)  # not on the answers' path
        await asyncio.sleep(0.05)
        assert (a.written, b.written, writes.owed, writes.writes) == (1, 1, 0, 2)
        writes.owe(b)  # a later fsync: a write of its own, in the next interval
        await asyncio.sleep(0.05)
        assert (a.written, b.written, writes.writes) == (1, 2, 3)

    asyncio.run(main())


def test_nothing_is_written_after_close() -> None:
    async def main() -> None:
        writes = FlushedIndexWrites(delay_s=0.01)
        part = _Part(0)
        writes.owe(part)
        writes.close()
        await asyncio.sleep(0.05)
        assert (part.written, writes.owed) == (0, 0)

    asyncio.run(main())
