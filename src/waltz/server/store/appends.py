"""Appends on their way through the store: one waiting append, how its fate is reported, the queue.

An append lives in exactly one place at a time: the partition's :class:`AppendQueue` (waiting for an id), a
batch of the store session that gave it one (in flight), or, after that session ended without committing
it, the survivors the partition hands to the next session's opening to decide. Its fate is reported one
way, to the :class:`AppendListener` it was submitted with, exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from waltz.protocol.records import Record, ReqId
from waltz.server.store.support import InvariantViolation

__all__ = ["FUTURES", "AppendListener", "AppendQueue", "PendingAppend"]

log = logging.getLogger(__name__)

_tuple_new = tuple.__new__


@dataclass(eq=False, slots=True)
class PendingAppend:
    """One append waiting for its transaction id. ``transaction_id`` is -1 until a batch assigns one."""

    req_id: ReqId
    header: int
    data: bytes
    checksum: int
    listener: AppendListener
    """Told of its resolution (with the other appends of its batch that share the listener)."""
    tag: object = None
    """What the submitter attached (the server's partition: the append's lock request; :data:`FUTURES`: the
    future of its id); the store never looks at it."""
    received_s: float = 0.0
    """When the submitter received the append (``time.monotonic()``), for its latency metric."""
    transaction_id: int = -1
    session_id: int = -1
    resolved: bool = False
    """The store decided its fate (it succeeded or failed), whether or not its caller still waits."""

    def record(self) -> Record:
        # Record(...) without its generated __new__: one per append on the write path.
        return _tuple_new(Record, (self.transaction_id, self.req_id, self.header, self.data, self.checksum))

    def succeed(self) -> bool:
        """Report it committed with its ``transaction_id``; False (nothing done) if it was resolved before."""
        if self.resolved:
            return False
        self.resolved = True
        try:
            self.listener.appends_committed((self,))
        except Exception:
            log.exception("an append's resolution listener failed")
        return True

    def fail(self, error: BaseException) -> bool:
        """Report that it did not commit and never will; False (nothing done) if it was resolved before."""
        if self.resolved:
            return False
        self.resolved = True
        try:
            self.listener.append_failed(self, error)
        except Exception:
            log.exception("an append's resolution listener failed")
        return True


class AppendListener(Protocol):
    """Hears how appends end, synchronously, in id order, inside the store's commit.

    Each append is reported exactly once: committed (its ``transaction_id`` set) or failed. A listener that
    raises is logged; the store's bookkeeping goes on."""

    def appends_committed(self, appends: Sequence[PendingAppend]) -> None:
        """``appends`` committed (ids in order, oldest first): usually a whole batch in one call."""
        ...

    def append_failed(self, append: PendingAppend, error: BaseException) -> None:
        """``append`` did not commit, and never will."""
        ...


class _FutureListener:
    """The listener of appends whose tag is an :class:`asyncio.Future` of their id (see :data:`FUTURES`)."""

    def appends_committed(self, appends: Sequence[PendingAppend]) -> None:
        for append in appends:
            future: asyncio.Future[int] = append.tag  # type: ignore[assignment]
            if not future.done():
                future.set_result(append.transaction_id)

    def append_failed(self, append: PendingAppend, error: BaseException) -> None:
        future: asyncio.Future[int] = append.tag  # type: ignore[assignment]
        if not future.done():
            future.set_exception(error)
            # The caller may have stopped waiting (cancelled); do not let asyncio warn about the exception.
            future.exception()


FUTURES: AppendListener = _FutureListener()
"""Resolves the future each of its appends carries as its tag (``StorePartition.append`` uses it)."""


class AppendQueue:
    """The appends waiting for ids, oldest first, at most ``capacity`` of them.

    Producers never wait inside the queue: one that finds it full waits for :meth:`wait_room` and offers its
    append again, so an append is either queued or still its producer's, never in between.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.items: deque[PendingAppend] = deque()
        """The queued appends, oldest first (read only: the methods change it; the store session reads it
        once or twice per batch, where a method call would cost more than the test)."""
        self.data_bytes = 0
        """Bytes of data queued (a batch is full by count or by bytes)."""
        # Every waiter clears its event, then waits: an event is set only while a waiter says it waits (set
        # is a Python call, and appends come and go once per append).
        self._room = asyncio.Event()
        self._room_awaited = False
        self._arrived = asyncio.Event()
        self._arrival_awaited = False

    def qsize(self) -> int:
        return len(self.items)

    def empty(self) -> bool:
        return not self.items

    def full(self) -> bool:
        return len(self.items) >= self.capacity

    async def wait_room(self) -> None:
        """Return once the queue has room (at once if it has), or was cleared."""
        while len(self.items) >= self.capacity:
            self._room.clear()
            self._room_awaited = True
            await self._room.wait()

    def put_nowait(self, append: PendingAppend) -> None:
        """Queue ``append`` now; the caller checked that the queue is not :meth:`full`."""
        if not self.offer(append):
            raise InvariantViolation(f"append queue full ({self.capacity})")

    def offer(self, append: PendingAppend) -> int:
        """Queue ``append`` if there is room: how many appends are queued now, 0 if none was (full)."""
        items = self.items
        n = len(items)
        if n >= self.capacity:
            return 0
        items.append(append)
        self.data_bytes += len(append.data)
        if self._arrival_awaited:
            # Only a getter that found the queue empty waits (after clearing the event): the append that
            # ends the emptiness wakes it, those after it need not.
            self._arrival_awaited = False
            self._arrived.set()
        return n + 1

    async def get(self) -> PendingAppend:
        while not self.items:
            self._arrived.clear()
            self._arrival_awaited = True
            await self._arrived.wait()
        return self.get_nowait()

    async def wait_arrived(self) -> None:
        """Return at once if an append is queued, else once one was queued (it may have been taken since:
        the store session's writer then checks again what to do)."""
        if not self.items:
            self._arrived.clear()
            self._arrival_awaited = True
            await self._arrived.wait()

    def peek(self) -> PendingAppend | None:
        """The oldest queued append, left in the queue (None if empty)."""
        return self.items[0] if self.items else None

    def get_nowait(self) -> PendingAppend:
        append = self.items.popleft()
        self.data_bytes -= len(append.data)
        if self._room_awaited:  # (once per batch, with take_more: no call while nobody waits)
            self._wake_room()
        return append

    def take_more(self, batch: list[PendingAppend], size: int, max_count: int, max_bytes: int) -> int:
        """Move the oldest queued appends onto ``batch`` (holding ``size`` data bytes) while it has fewer than
        ``max_count`` and the next one fits in ``max_bytes``; return the batch's data bytes.

        One call per batch rather than a :meth:`peek` and :meth:`get_nowait` per append: forming batches is
        per-record work on the write path."""
        items = self.items
        room = max_count - len(batch)
        if len(items) <= room and size + self.data_bytes <= max_bytes:
            # Everything queued fits (the common case under a steady load): take it in one C call.
            batch.extend(items)
            items.clear()
            size += self.data_bytes
            self.data_bytes = 0
            if self._room_awaited:
                self._wake_room()
            return size
        taken = 0
        while room > 0 and items:
            n = len(items[0].data)
            if size + n > max_bytes:
                break
            batch.append(items.popleft())
            size += n
            taken += n
            room -= 1
        self.data_bytes -= taken
        if self._room_awaited:
            self._wake_room()
        return size

    def _wake_room(self) -> None:
        """Wake the producers that wait for room (they set ``_room_awaited`` before they wait)."""
        self._room_awaited = False
        self._room.set()

    def clear(self) -> list[PendingAppend]:
        """Take every queued append (oldest first) and wake the producers waiting for room."""
        items = list(self.items)
        self.items.clear()
        self.data_bytes = 0
        self._room_awaited = False
        self._room.set()
        return items
