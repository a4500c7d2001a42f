"""A server partition's memory is bounded by its configuration, not by the number of transactions written.

One :class:`Partition` in this process, on a real :class:`StorePartition` whose three replicas hold nothing
and acknowledge every batch a moment later (so the test measures the server, not a fake storage node), and
one mounted client whose feed is served. Appends go through the server's own decode and append path, without
locks (the lock table is an array of ``lock_table_size`` slots allocated at the first locked append; the
slots of recent lock values are remembered once per server, under 4 MB). ``tracemalloc`` counts what the
partition still holds after N and after 3N transactions: the feed cache's and the transaction data cache's
configured bytes and a little more, the same after 3N as after N.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Sequence
from typing import Any, cast

from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.feed_cache import FeedCache, FeedEntry
from waltz.server.partition import Partition
from waltz.server.store.interfaces import ReplicaConnector
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache
from waltz.testing.store import MemoryMetadataStore, NullConnector

VERSION = max(cs.SUPPORTED_VERSIONS)
CLIENT = 7
FEED_CACHE_BYTES = 256 * 1024
DATA_CACHE_BYTES = 512 * 1024
SLACK_BYTES = 64 * 1024
"""What the partition may hold besides its caches once they are full (queues, dict tables, the feed)."""


class _Peer:
    """The client's connection: opens the feed windows as a client does, counts what the feed sends."""

    def __init__(self) -> None:
        self.closed = False
        self.drain_needed = False
        self.fed = 0
        self.last_id = -1
        self.partition: Partition | None = None
        self.wake = asyncio.Event()

    def send(self, msg: cs.Message) -> None:
        assert self.partition is not None
        if isinstance(msg, cs.FeedSuspended):
            loop = asyncio.get_running_loop()
            loop.call_soon(self.partition.feed_request, self, cs.FeedRequest(msg.req_id, self.last_id))
        elif isinstance(msg, cs.MountResponse):
            self.partition.feed_request(cast(Any, self), cs.FeedRequest(msg.req_id, self.last_id))
        elif isinstance(msg, cs.LockFailure):
            raise AssertionError(f"no append of this test conflicts: {msg}")

    def send_feed(self, entries: Sequence[FeedEntry], frames: dict[int, bytes] | None = None) -> None:
        cs.frame_feed_entries(entries, VERSION)
        self.fed += len(entries)
        self.last_id = entries[-1][0]
        self.wake.set()

    async def drain(self) -> None:
        pass


def _payload(i: int) -> bytes:
    """An encoded 512-byte append, no locks (as ``bench/soak.py`` appends)."""
    msg = cs.AppendRequest.build(ReqId.of(CLIENT, 1, 0, i), -1, 0, i.to_bytes(4, "big") * 128)
    return cs.encode(msg, VERSION)


async def _append_until(part: Partition, peer: _Peer, start: int, stop: int) -> None:
    """Append transactions ``start..stop-1`` (64 unanswered at most) and wait until the feed sent them."""
    sent = start
    while peer.fed < stop:
        while sent < stop and sent - peer.fed < 64:
            assert await part.append(cast(Any, peer), cs.decode_append_fields(_payload(sent), VERSION))
            sent += 1
        peer.wake.clear()
        if peer.fed < stop:
            await peer.wake.wait()


def _retained() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def _measure(counts: Sequence[int]) -> list[int]:
    """What the partition holds, beyond what it held once mounted, after each of ``counts`` transactions."""
    store = StorePartition(
        0,
        1,
        ["s1", "s2", "s3"],
        connector=cast(ReplicaConnector, NullConnector()),
        metadata_store=MemoryMetadataStore(),
    )
    part = Partition(
        0,
        store,
        feed_cache=FeedCache(FEED_CACHE_BYTES),
        transaction_cache=TransactionCache(DATA_CACHE_BYTES),
    )
    await part.start()
    await part.wait_ready()
    peer = _Peer()
    peer.partition = part
    await part.mount(cast(Any, peer), cs.MountRequest(ReqId.of(CLIENT, 1, 0, -1), -1, 1))
    await _append_until(part, peer, 0, 256)  # every queue and task in use once
    tracemalloc.start()
    try:
        base = _retained()
        out = []
        done = 256
        for count in counts:
            await _append_until(part, peer, done, count)
            done = count
            out.append(_retained() - base)
        return out
    finally:
        tracemalloc.stop()
        await part.close()


def test_retained_memory_is_the_configured_caches_and_does_not_grow_with_the_transactions() -> None:
    # 20,000 transactions fill both caches (the feed cache holds about 8,000 transactions' headers, the
    # data cache about 600 transactions); 60,000 write three times as many.
    after_n, after_3n = asyncio.run(_measure([20_000, 60_000]))
    configured = FEED_CACHE_BYTES + DATA_CACHE_BYTES
    # Bounded by the configuration: the caches cost what they are configured to, and little else is kept.
    assert after_n <= configured + SLACK_BYTES, (after_n, configured)
    assert after_3n <= configured + SLACK_BYTES, (after_3n, configured)
    # Not by the log's length: 40,000 more transactions add less than a byte each (what the LRUs' dict
    # tables happen to hold moves by a few KB).
    assert after_3n - after_n < 32 * 1024, (after_n, after_3n)
