"""The feed cache: recent record headers (id -> ReqId, header) of every partition this server owns.

Feed threads serve FeedData from here, so a committed transaction is read from storage at most once per block
while it stays hot. Design (after the original ``FeedCache``):

* A **block** holds the headers of 64 consecutive transaction ids of one partition, keyed by
  ``(partition, id & ~63)``. Entries are packed as 28-byte ``RecordHeader`` structs in one ``bytearray``
  plus a presence bitmask, so a block costs :data:`BLOCK_BYTES` (about 2.1 KB) however many entries it
  holds, and the byte bound is honest about Python memory rather than counting small objects.
* The cache holds at most ``max_bytes // BLOCK_BYTES`` blocks (at least one local LRU's worth plus one).
* Each partition has a **local LRU** of at most ``clamp(max_blocks // (num_partitions + 1), 2, 10000)``
  blocks. A block pushed out of a local LRU moves to a **shared pool** (one LRU for all partitions); a lookup
  that finds its block in the pool moves it back to its partition's local LRU. When the cache is full, a new
  block evicts the oldest block of the pool, so one partition scanning a long catch-up range cannot evict
  the hot blocks of the others beyond what the pool holds.

Guarantees: :meth:`FeedCache.get` never returns a header for an id it was not given for that partition
(headers of committed transactions never change, so a cached entry is never stale); the number of blocks
never exceeds the bound. Single-threaded (the event loop), no locking.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from waltz.protocol.records import HEADER_STRUCT, RecordHeader, ReqId

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_ENTRIES",
    "DEFAULT_FEED_CACHE_BYTES",
    "FeedCache",
    "FeedCacheStatistics",
    "FeedEntry",
    "HeaderLike",
]

_tuple_new = tuple.__new__

FeedEntry = tuple[int, int, int, int]
"""A cached header, flat: ``(transaction id, ReqId msb, ReqId lsb, header)``."""


class HeaderLike(Protocol):
    """What :meth:`FeedCache.add_run` reads of each committed append (a store's pending append, a Record)."""

    @property
    def transaction_id(self) -> int: ...

    @property
    def req_id(self) -> ReqId: ...

    @property
    def header(self) -> int: ...


BLOCK_ENTRIES = 64
"""Consecutive transaction ids per block."""

_ENTRY_BYTES = HEADER_STRUCT.size  # 28: transaction id, ReqId, header
_LOW_BITS = BLOCK_ENTRIES - 1
_FULL_MASK = (1 << BLOCK_ENTRIES) - 1

BLOCK_BYTES = BLOCK_ENTRIES * _ENTRY_BYTES + 320
"""What one block costs: its packed entries plus the objects around them, as measured (``tracemalloc``,
CPython 3.11, 20,000 blocks: 2,089 bytes each, the ``_Block``, its ``present`` int, the key and the LRU's
dict slot and node included) plus malloc's 16-byte header of the entries' buffer. So ``max_bytes`` is what
the cache really holds (``tests/unit/test_server_memory.py`` checks it)."""

DEFAULT_FEED_CACHE_BYTES = 64 * 1024 * 1024
"""``server.feedCacheSize`` default."""

MIN_LOCAL_BLOCKS = 2
MAX_LOCAL_BLOCKS = 10000


class _Block:
    """64 packed header slots of one partition; bit ``i`` of ``present`` says slot ``i`` holds an entry."""

    __slots__ = ("entries", "present")

    def __init__(self) -> None:
        self.entries = bytearray(BLOCK_ENTRIES * _ENTRY_BYTES)
        self.present = 0

    def put(self, index: int, header: RecordHeader) -> None:
        HEADER_STRUCT.pack_into(
            self.entries,
            index * _ENTRY_BYTES,
            header.transaction_id,
            header.req_id.msb,
            header.req_id.lsb,
            header.header,
        )
        self.present |= 1 << index

    def get(self, index: int) -> RecordHeader | None:
        if not (self.present >> index) & 1:
            return None
        txn, msb, lsb, header = HEADER_STRUCT.unpack_from(self.entries, index * _ENTRY_BYTES)
        return RecordHeader(txn, ReqId(msb, lsb), header)


@dataclass(frozen=True, slots=True)
class FeedCacheStatistics:
    """A snapshot of the feed cache's counters."""

    hits: int
    misses: int
    blocks: int
    max_blocks: int
    pool_blocks: int
    evictions: int


class FeedCache:
    """Bounded cache of record headers for all partitions of this server; see the module docstring."""

    def __init__(self, max_bytes: int = DEFAULT_FEED_CACHE_BYTES, num_partitions: int = 1) -> None:
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be positive, got {num_partitions}")
        self.local_max_blocks = min(
            MAX_LOCAL_BLOCKS, max(MIN_LOCAL_BLOCKS, (max_bytes // BLOCK_BYTES) // (num_partitions + 1))
        )
        # Never fewer blocks than one full local LRU plus one, so a single partition can always make progress.
        self.max_blocks = max(max_bytes // BLOCK_BYTES, self.local_max_blocks + 1)
        self._local: dict[int, OrderedDict[int, _Block]] = {}
        self._pool: OrderedDict[tuple[int, int], _Block] = OrderedDict()
        self._blocks = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    # -- lookups ---------------------------------------------------------------------------------------------

    def _find(self, partition: int, base: int) -> _Block | None:
        local = self._local.get(partition)
        if local is not None:
            block = local.get(base)
            if block is not None:
                local.move_to_end(base)
                return block
        block = self._pool.pop((partition, base), None)
        if block is not None:
            # Back into its partition's LRU as the most recent block; that may push an older one to the pool.
            self._insert_local(partition, base, block)
        return block

    def get(self, partition: int, transaction_id: int) -> RecordHeader | None:
        """The header of ``transaction_id`` in ``partition``, or None (a miss) if it is not cached."""
        block = self._find(partition, transaction_id & ~_LOW_BITS)
        result = None if block is None else block.get(transaction_id & _LOW_BITS)
        if result is None:
            self.misses += 1
        else:
            self.hits += 1
        return result

    def get_range(self, partition: int, start: int, max_count: int) -> list[RecordHeader]:
        """Consecutive cached headers from ``start``: up to ``max_count``, stopping at the first missing id.

        Counts one hit per header returned, and one miss if it stopped early on an uncached id.
        """
        new = _tuple_new
        return [
            new(RecordHeader, (t, new(ReqId, (msb, lsb)), h))
            for t, msb, lsb, h in self.get_entries(partition, start, max_count)
        ]

    def get_entries(self, partition: int, start: int, max_count: int) -> list[FeedEntry]:
        """:meth:`get_range` as flat ``(transaction id, ReqId msb, ReqId lsb, header)`` tuples, unpacked in
        C (a feed sends one per commit and needs no RecordHeader for it). Counts hits and misses the same
        way."""
        out: list[FeedEntry] = []
        txn = start
        stop = start + max_count
        while txn < stop:
            block = self._find(partition, txn & ~_LOW_BITS)
            if block is None:
                break
            index = txn & _LOW_BITS
            # Take the run of present entries in this block without going back through _find: the run's
            # length is the count of trailing one bits of ``present`` from ``index``, its entries unpacked
            # in one C loop.
            wanted = min(BLOCK_ENTRIES - index, stop - txn)
            bits = block.present >> index
            run = min(wanted, ((bits + 1) & ~bits).bit_length() - 1)
            if run:
                view = memoryview(block.entries)[index * _ENTRY_BYTES : (index + run) * _ENTRY_BYTES]
                out += HEADER_STRUCT.iter_unpack(view)
                txn += run
            if run < wanted:
                break
        self.hits += len(out)
        if len(out) < max_count:
            self.misses += 1
        return out

    # -- insertion -------------------------------------------------------------------------------------------

    def add(self, partition: int, header: RecordHeader) -> None:
        """Cache ``header`` (a just-committed transaction, or one read from storage)."""
        self.add_entry(partition, header.transaction_id, header.req_id, header.header)

    def add_entry(self, partition: int, transaction_id: int, req_id: ReqId, header: int) -> None:
        """:meth:`add` of ``RecordHeader(transaction_id, req_id, header)`` without building it (the server
        caches one per commit)."""
        if transaction_id < 0:
            raise ValueError(f"transaction ids are not negative, got {transaction_id}")
        base = transaction_id & ~_LOW_BITS
        # _find's first step inlined: the block of the newest commits is nearly always in the local LRU.
        local = self._local.get(partition)
        block = None
        if local is not None:
            block = local.get(base)
            if block is not None:
                local.move_to_end(base)
        if block is None:
            block = self._find(partition, base)
            if block is None:
                block = self._allocate(partition, base)
        index = transaction_id & _LOW_BITS
        HEADER_STRUCT.pack_into(
            block.entries, index * _ENTRY_BYTES, transaction_id, req_id[0], req_id[1], header
        )
        block.present |= 1 << index

    def add_run(self, partition: int, items: Iterable[HeaderLike]) -> None:
        """:meth:`add` of each of ``items`` (consecutive ids, oldest first: a committed batch), one call per
        batch: each block is looked up once for the entries it takes, not once per entry."""
        pack = HEADER_STRUCT.pack_into
        base = -1
        block: _Block | None = None
        entries = bytearray()
        present = 0
        for item in items:
            txn = item.transaction_id
            if txn < 0:
                raise ValueError(f"transaction ids are not negative, got {txn}")
            if txn & ~_LOW_BITS != base:
                if block is not None:
                    block.present |= present
                base = txn & ~_LOW_BITS
                # The newest block, usually local: found, or allocated.
                block = self._find(partition, base) or self._allocate(partition, base)
                entries = block.entries
                present = 0
            index = txn & _LOW_BITS
            rid = item.req_id
            pack(entries, index * _ENTRY_BYTES, txn, rid[0], rid[1], item.header)
            present |= 1 << index
        if block is not None:
            block.present |= present

    def fill(self, partition: int, headers: Iterable[RecordHeader]) -> None:
        """Cache many headers, e.g. the rest of a block read from storage after a miss."""
        for header in headers:
            self.add(partition, header)

    def evict_partition(self, partition: int) -> None:
        """Drop every block of ``partition`` (the server no longer owns it)."""
        local = self._local.pop(partition, None)
        if local is not None:
            self._blocks -= len(local)
        stale = [key for key in self._pool if key[0] == partition]
        for key in stale:
            del self._pool[key]
        self._blocks -= len(stale)

    def statistics(self) -> FeedCacheStatistics:
        return FeedCacheStatistics(
            hits=self.hits,
            misses=self.misses,
            blocks=self._blocks,
            max_blocks=self.max_blocks,
            pool_blocks=len(self._pool),
            evictions=self.evictions,
        )

    # -- internals -------------------------------------------------------------------------------------------

    def _insert_local(self, partition: int, base: int, block: _Block) -> None:
        local = self._local.get(partition)
        if local is None:
            local = self._local[partition] = OrderedDict()
        local[base] = block
        if len(local) > self.local_max_blocks:
            old_base, old_block = local.popitem(last=False)
            self._pool[(partition, old_base)] = old_block

    def _allocate(self, partition: int, base: int) -> _Block:
        if self._blocks >= self.max_blocks:
            self._evict_one()
        block = _Block()
        self._blocks += 1
        self._insert_local(partition, base, block)
        return block

    def _evict_one(self) -> None:
        if self._pool:
            self._pool.popitem(last=False)
        else:
            # The pool is empty only when the local LRUs hold every block; take the oldest block of the
            # partition that holds the most, which keeps the partitions' shares even.
            victim = max(self._local, key=lambda p: len(self._local[p]))
            local = self._local[victim]
            local.popitem(last=False)
            if not local:
                del self._local[victim]
        self._blocks -= 1
        self.evictions += 1
