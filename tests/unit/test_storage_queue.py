"""The storage partition queue: FIFO for items, and fair to producers waiting for room."""

from __future__ import annotations

import asyncio

import pytest

from waltz.protocol import storage as st
from waltz.storage.work import BoundedQueue, Item, Tally

pytestmark = pytest.mark.timeout(30)


def item(seq: int) -> Item:
    return Item(st.MaxTransactionIdRequest(0, seq, 0, False), None)


def seqs(items: list[Item]) -> list[int]:
    return [i.msg.seq_num for i in items if i.msg is not None]


def test_a_flooding_producer_does_not_take_the_slot_another_waits_for() -> None:
    """The flake of test_back_pressure_a_peer_that_does_not_read: a connection that always has another
    request ready took every freed slot before a waiting connection ran, which then waited forever."""

    async def go() -> list[int]:
        queue = BoundedQueue(1)
        await queue.put(item(0))
        order: list[int] = []

        async def flood() -> None:
            for seq in range(1, 6):
                await queue.put(item(seq))  # the next one right after, as a reader with buffered requests

        flooder = asyncio.create_task(flood())
        await asyncio.sleep(0)  # the flooder now waits for room
        other = asyncio.create_task(queue.put(item(100)))
        await asyncio.sleep(0)
        while len(order) < 7:
            order.extend(seqs([await queue.get()]))
            await asyncio.sleep(0)
        await asyncio.gather(flooder, other)
        return order

    order = asyncio.run(go())
    assert order[:3] == [0, 1, 100], order
    assert sorted(order) == [0, 1, 2, 3, 4, 5, 100]


def test_put_nowait_only_when_there_is_room_and_nobody_waits() -> None:
    async def go() -> None:
        queue = BoundedQueue(2)
        assert queue.put_nowait(item(1))
        assert queue.put_nowait(item(2))
        assert not queue.put_nowait(item(3))  # full
        waiting = asyncio.create_task(queue.put(item(4)))
        await asyncio.sleep(0)
        assert seqs([queue.pop()]) == [1]  # the waiting producer's item moves into the freed slot at once
        assert not queue.put_nowait(item(5))  # full again
        await waiting
        assert seqs([queue.pop(), queue.pop()]) == [2, 4]
        assert len(queue) == 0

    asyncio.run(go())


def test_a_cancelled_producer_leaves_no_item_behind() -> None:
    async def go() -> None:
        queue = BoundedQueue(1)
        queue.put_nowait(item(1))
        cancelled = asyncio.create_task(queue.put(item(2)))
        kept = asyncio.create_task(queue.put(item(3)))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        assert seqs([queue.pop()]) == [1]
        await kept
        assert seqs([queue.pop()]) == [3]
        assert queue.peek() is None

    asyncio.run(go())


def test_queues_sharing_a_tally_count_every_queued_item() -> None:
    """The node's tally says whether another partition has work waiting (its fsync then leaves the loop)."""

    async def go() -> None:
        tally = Tally()
        a, b = BoundedQueue(1, tally), BoundedQueue(4, tally)
        a.put_nowait(item(1))
        waiting = asyncio.create_task(a.put(item(2)))
        await asyncio.sleep(0)
        b.put_nowait(item(3))
        assert tally.items == 2  # a waiting producer's item is not queued yet
        a.pop()
        await waiting
        assert tally.items == 2
        a.pop()
        b.pop()
        assert tally.items == 0

    asyncio.run(go())
