"""The transaction data cache and the fetcher that fills it, shared by all partitions of a server.

:class:`TransactionCache` is a byte-bounded LRU of ``(partition, transaction id) -> (data, checksum)``. An
entry costs ``len(data) + ENTRY_OVERHEAD_BYTES``; entries costing more than a quarter of the capacity are
not cached, so one huge transaction cannot flush everything else. Committed transaction data never changes,
so an entry is never stale. The checksum is the client's CRC-32, kept so the client can verify the data end
to end.

:class:`TransactionFetcher` answers TransactionDataRequests: from the cache, or else through an async
*loader* (a store read). Concurrent fetches of the same key share one load (one in-flight load per key; the
others await the same result), at most ``max_in_flight`` loads run at once (further distinct keys wait for a
slot; how many requests can wait is bounded by the network layer's per-connection throttling), a successful
load is cached, and a failed load is raised to every waiter of that load and not cached, so the next fetch
tries again.

Both are single-threaded (one event loop) and need no locking.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from waltz.errors import ClosedResourceError

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT_FETCHES",
    "DEFAULT_TRANSACTION_CACHE_BYTES",
    "DataLike",
    "ENTRY_OVERHEAD_BYTES",
    "TransactionCache",
    "TransactionCacheStatistics",
    "TransactionData",
    "TransactionFetcher",
    "TransactionLoader",
]

DEFAULT_TRANSACTION_CACHE_BYTES = 128 * 1024 * 1024
"""``server.transactionDataCacheSize`` default."""

ENTRY_OVERHEAD_BYTES = 344
"""What one entry costs beyond its data, as measured (``tracemalloc``, CPython 3.11, 200,000 entries: 326
bytes for the data's ``bytes`` header, the key and value tuples, their ints and the LRU's dict slot and node)
plus malloc's 16-byte header of data over 512 bytes. So ``max_bytes`` is what the cache really holds
(``tests/unit/test_server_memory.py`` checks it)."""

DEFAULT_MAX_IN_FLIGHT_FETCHES = 64


_tuple_new = tuple.__new__


class TransactionData(NamedTuple):
    """The data of one transaction and the CRC-32 its client computed."""

    data: bytes
    checksum: int


class DataLike(Protocol):
    """What :meth:`TransactionCache.put_run` reads of each committed append (a store's pending append)."""

    @property
    def transaction_id(self) -> int: ...

    @property
    def data(self) -> bytes: ...

    @property
    def checksum(self) -> int: ...


TransactionLoader = Callable[[int, int], Awaitable[TransactionData]]
"""``async loader(partition, transaction_id) -> TransactionData``: reads a committed transaction."""


@dataclass(frozen=True, slots=True)
class TransactionCacheStatistics:
    """A snapshot of the cache's counters."""

    hits: int
    misses: int
    entries: int
    size_bytes: int
    max_bytes: int
    evictions: int
    rejected_too_large: int


class TransactionCache:
    """Byte-bounded LRU cache of transaction data; see the module docstring."""

    def __init__(self, max_bytes: int = DEFAULT_TRANSACTION_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, got {max_bytes}")
        self.max_bytes = max_bytes
        # Items above this never enter the cache (a quarter of the capacity, as in the original).
        self.max_item_bytes = max_bytes // 4
        self._entries: OrderedDict[tuple[int, int], TransactionData] = OrderedDict()
        self._size_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.rejected_too_large = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._entries

    @property
    def size_bytes(self) -> int:
        """The summed cost of the cached entries; never above ``max_bytes``."""
        return self._size_bytes

    def get(self, partition: int, transaction_id: int) -> TransactionData | None:
        """The cached data of the transaction (now the most recently used entry), or None."""
        key = (partition, transaction_id)
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, partition: int, transaction_id: int, data: bytes, checksum: int) -> bool:
        """Cache the data as the most recently used entry, evicting the least recently used as needed.

        Returns False (and caches nothing) if the entry costs more than a quarter of the capacity.
        """
        cost = len(data) + ENTRY_OVERHEAD_BYTES
        if cost > self.max_item_bytes:
            self.rejected_too_large += 1
            return False
        key = (partition, transaction_id)
        entries = self._entries
        old = entries.pop(key, None)
        if old is not None:
            self._size_bytes -= len(old.data) + ENTRY_OVERHEAD_BYTES
        while self._size_bytes + cost > self.max_bytes:
            _, evicted = entries.popitem(last=False)
            self._size_bytes -= len(evicted.data) + ENTRY_OVERHEAD_BYTES
            self.evictions += 1
        # TransactionData(...) without its generated __new__: the server caches one per commit.
        entries[key] = _tuple_new(TransactionData, (data, checksum))
        self._size_bytes += cost
        return True

    def put_run(self, partition: int, items: Sequence[DataLike]) -> int:
        """:meth:`put` of each of ``items`` (a committed batch), in order, in one call: the server caches
        every commit, and a call per transaction was a good part of the cost. Returns the data bytes of all
        of ``items``, cached or not (the server counts them: one loop over the batch less)."""
        entries = self._entries
        max_item = self.max_item_bytes
        max_bytes = self.max_bytes
        size = self._size_bytes
        new = _tuple_new
        data_bytes = 0
        try:
            for item in items:
                data = item.data
                cost = len(data) + ENTRY_OVERHEAD_BYTES
                data_bytes += cost
                if cost > max_item:
                    self.rejected_too_large += 1
                    continue
                key = (partition, item.transaction_id)
                old = entries.pop(key, None)
                if old is not None:
                    size -= len(old.data) + ENTRY_OVERHEAD_BYTES
                while size + cost > max_bytes:
                    _, evicted = entries.popitem(last=False)
                    size -= len(evicted.data) + ENTRY_OVERHEAD_BYTES
                    self.evictions += 1
                entries[key] = new(TransactionData, (data, item.checksum))
                size += cost
        finally:
            self._size_bytes = size
        # The overheads added per item come off in one subtraction.
        return data_bytes - ENTRY_OVERHEAD_BYTES * len(items)

    def evict_partition(self, partition: int) -> None:
        """Drop every entry of ``partition`` (the server no longer owns it)."""
        for key in [key for key in self._entries if key[0] == partition]:
            self._size_bytes -= len(self._entries.pop(key).data) + ENTRY_OVERHEAD_BYTES

    def clear(self) -> None:
        self._entries.clear()
        self._size_bytes = 0

    def statistics(self) -> TransactionCacheStatistics:
        return TransactionCacheStatistics(
            hits=self.hits,
            misses=self.misses,
            entries=len(self._entries),
            size_bytes=self._size_bytes,
            max_bytes=self.max_bytes,
            evictions=self.evictions,
            rejected_too_large=self.rejected_too_large,
        )


class TransactionFetcher:
    """Cache-first transaction data reads with per-key coalescing and a bound on concurrent loads.

    The fetcher owns its load tasks: each runs the loader once and is shared by every concurrent
    :meth:`fetch` of its key. A waiter that is cancelled does not cancel the load for the others;
    :meth:`aclose` cancels every load still running and waits for them.
    """

    def __init__(
        self,
        cache: TransactionCache,
        loader: TransactionLoader,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT_FETCHES,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be positive, got {max_in_flight}")
        self.cache = cache
        self._loader = loader
        self.max_in_flight = max_in_flight
        self._in_flight: dict[tuple[int, int], asyncio.Task[TransactionData]] = {}
        # Created lazily so the fetcher can be built outside a running event loop.
        self._slots: asyncio.Semaphore | None = None
        self._closed = False
        self.loads = 0
        self.coalesced = 0

    @property
    def in_flight(self) -> int:
        """Keys with a load running or waiting for a load slot."""
        return len(self._in_flight)

    def put(self, partition: int, transaction_id: int, data: bytes, checksum: int) -> None:
        """Cache newly committed data, so the first reads of a fresh transaction need no store read."""
        self.cache.put(partition, transaction_id, data, checksum)

    async def fetch(self, partition: int, transaction_id: int) -> TransactionData:
        """The data of a committed transaction: from the cache, else from the one shared load of that key.

        Raises whatever the loader raised (to every concurrent waiter of that load); nothing is cached then.
        """
        cached = self.cache.get(partition, transaction_id)
        if cached is not None:
            return cached
        if self._closed:
            raise ClosedResourceError("the transaction fetcher is closed")
        key = (partition, transaction_id)
        task = self._in_flight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._load(key), name=f"fetch-txn-P{partition}-{transaction_id}"
            )
            self._in_flight[key] = task
            task.add_done_callback(functools.partial(self._on_load_done, key))
        else:
            self.coalesced += 1
        # shield: one waiter being cancelled must not cancel the load the other waiters share.
        return await asyncio.shield(task)

    async def _load(self, key: tuple[int, int]) -> TransactionData:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        async with self._slots:
            # Another load (or put() of a commit) may have filled the cache while this one waited.
            if key in self.cache:
                cached = self.cache.get(*key)
                if cached is not None:
                    return cached
            self.loads += 1
            result = await self._loader(*key)
        # Cache before the in-flight entry goes away (done callback), so no fetch finds neither.
        self.cache.put(key[0], key[1], result.data, result.checksum)
        return result

    def _on_load_done(self, key: tuple[int, int], task: asyncio.Task[TransactionData]) -> None:
        if self._in_flight.get(key) is task:
            del self._in_flight[key]
        if not task.cancelled():
            # Mark the exception retrieved: if every waiter was cancelled, nobody else will look at it, and
            # asyncio would log "exception was never retrieved". Waiters still get it through the shield.
            task.exception()

    async def aclose(self) -> None:
        """Cancel every running load and wait for them; later cache misses raise ClosedResourceError."""
        self._closed = True
        tasks = list(self._in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
