"""The work a partition worker takes: a queued item, the bounded partition queue, a connection's bound
on unanswered requests, and the limits of one request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from waltz.protocol import storage as st
from waltz.transport import (
    ByteBudget,
    FramedConnection,
)

log = logging.getLogger(__name__)


MAX_LIST_RECORDS = 10_000
"""Largest record list one request may ask for; larger requests are answered with at most this many."""
MAX_LIST_BYTES = 8 * 1024 * 1024
"""A list response stops after this many data bytes (always at least one record), to bound frames."""
MAX_DAMAGED_REPORTED = 1000
"""Damaged transaction ids remembered per partition (for metrics, /health and ``cluster verify``)."""
REFUSAL_LOG_INTERVAL_S = 10.0
"""At most one warning per partition per this many seconds about refused session ids (and one ERROR line
about refused truncations)."""


class InFlight:
    """A connection's unanswered requests, at most ``capacity``: taken without a coroutine while there is
    room (:meth:`try_acquire`), waited for in arrival order when there is none (:meth:`acquire`)."""

    __slots__ = ("_freed", "capacity", "count")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0
        self._freed: asyncio.Event | None = None

    def try_acquire(self) -> bool:
        if self.count >= self.capacity:
            return False
        self.count += 1
        return True

    async def acquire(self) -> None:
        # One connection's requests are admitted by its one serving task, so there is one waiter at most.
        while self.count >= self.capacity:
            freed = self._freed = asyncio.Event()
            await freed.wait()
        self.count += 1

    def release(self) -> None:
        self.count -= 1
        freed = self._freed
        if freed is not None:
            self._freed = None
            freed.set()


@dataclass(slots=True)
class Item:
    """One queued unit of work for a partition worker."""

    msg: st.StorageMessage | None
    conn: FramedConnection | None
    op: Callable[[], Any] | None = None
    done: asyncio.Future[Any] | None = None
    slot: InFlight | None = None
    arrived_s: float = 0.0
    budget: ByteBudget | None = None
    reserved: int = 0
    """Bytes of ``budget`` this request's response holds until it is handed to the connection."""


class Tally:
    """A count shared by the partition queues of a node: the requests queued in all of them."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items = 0


class BoundedQueue:
    """A FIFO with a capacity and peeking, which asyncio.Queue lacks (group commit needs to look ahead).

    Fair to producers: when the queue is full, producers wait in arrival order and each freed slot goes to
    the one that has waited longest (its item moves in as the slot frees), so a connection that floods a
    partition cannot keep taking the slots another connection is waiting for.
    """

    def __init__(self, capacity: int, tally: Tally | None = None) -> None:
        self._items: collections.deque[Item] = collections.deque()
        self._capacity = capacity
        self._tally = tally if tally is not None else Tally()
        """Counts the items of every queue sharing it (the node's: see ``StoragePartition._fsync``)."""
        self._not_empty = asyncio.Event()
        self._putters: collections.deque[tuple[Item, asyncio.Future[None]]] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Item) -> bool:
        """Queue ``item`` if there is room and no producer is waiting; False (nothing queued) otherwise."""
        if self._putters or len(self._items) >= self._capacity:
            return False
        self._items.append(item)
        self._tally.items += 1
        self._not_empty.set()
        return True

    async def put(self, item: Item) -> None:
        if self.put_nowait(item):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (item, waiter)
        self._putters.append(entry)
        try:
            await waiter  # pop() moves the item in before it resolves this
        except BaseException:
            if not waiter.done() or waiter.cancelled():
                with contextlib.suppress(ValueError):
                    self._putters.remove(entry)
            raise

    async def get(self) -> Item:
        while not self._items:
            self._not_empty.clear()
            await self._not_empty.wait()
        return self.pop()

    def peek(self) -> Item | None:
        return self._items[0] if self._items else None

    def pop(self) -> Item:
        item = self._items.popleft()
        self._tally.items -= 1
        while self._putters and len(self._items) < self._capacity:
            waiting, waiter = self._putters.popleft()
            if waiter.done():  # cancelled while waiting: its item never goes in
                continue
            self._items.append(waiting)
            self._tally.items += 1
            waiter.set_result(None)
        return item
