"""A locked append that finds a lock slot busy waits only for the append holding it, not for all in flight.

The store under the partition is a small fake (this tests the partition alone) that resolves appends in order,
in batches the test chooses, as the real store does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.feed_cache import FeedCache
from waltz.server.partition import Partition
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache
from waltz.testing.partition_store import ManualStore, RecordingPeer


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def _mounted(store: ManualStore) -> AsyncIterator[tuple[Partition, Any]]:
    """Partition 0 on ``store``, started, with one client (session ``ReqId.of(7, 1, 0, -1)``) mounted; closed
    on exit."""
    part = Partition(
        0,
        cast(StorePartition, store),
        feed_cache=FeedCache(1 << 20, 1),
        transaction_cache=TransactionCache(1 << 20),
    )
    await part.start()
    peer = cast(Any, RecordingPeer())
    await part.mount(peer, cs.MountRequest(ReqId.of(7, 1, 0, -1), -1, 1))
    try:
        yield part, peer
    finally:
        await part.close()


def test_a_collision_wait_ends_when_the_holder_resolves_while_a_later_batch_is_in_flight() -> None:
    async def main() -> None:
        store = ManualStore()
        async with _mounted(store) as (part, peer):

            def append(seq: int, lock: int, client_hwm: int) -> cs.AppendRequest:
                return cs.AppendRequest.build(
                    ReqId.of(7, 1, 0, seq), client_hwm, 0, b"x", write_locks=(lock,)
                )

            # Append 0 holds lock 100; append 1 (lock 200) is in flight behind it; append 2 needs lock 100
            # again (its slots are busy; its client has seen transaction 0, so it will not conflict) and
            # append 3 (lock 300) arrives behind append 2.
            for seq, lock, client_hwm in ((0, 100, -1), (1, 200, -1), (2, 100, 0), (3, 300, -1)):
                assert await part.append(peer, append(seq, lock, client_hwm))
            await _settle()
            assert [m.req_id.seq_num for m in store.submitted] == [0, 1]
            # Append 0 commits; append 1 is still in flight. Append 2's slots are free now: it goes to the
            # store at once, and append 3 right behind it (never before it).
            store.commit(1)
            await _settle()
            assert [m.req_id.seq_num for m in store.submitted] == [0, 1, 2, 3]
            store.commit(3)
            await _settle()
            assert store.high_water_mark == 3
            assert not [m for m in peer.sent if isinstance(m, cs.LockFailure)]

    asyncio.run(main())


def test_lock_slots_busy_with_nothing_pending_are_reset_with_a_warning(caplog: Any) -> None:
    async def main() -> None:
        store = ManualStore()
        async with _mounted(store) as (part, peer):
            # A leaked busy mark: taken, and no append in the store will ever release it.
            locks = part._locks
            assert locks is not None
            assert locks.begin((100,)) is not None
            req = cs.AppendRequest.build(ReqId.of(7, 1, 0, 0), -1, 0, b"x", write_locks=(100,))
            assert await part.append(peer, req)
            await _settle()
            assert [m.req_id.seq_num for m in store.submitted] == [0]

    asyncio.run(main())
    assert "lock slots busy with nothing pending; resetting" in caplog.text
