"""The client core's state, per partition and per submitted context (event loop only, except where said).

:class:`PartitionState` holds what the core knows about one mounted partition (mount state, monitor, feed
queue, slots, the lock queue, a stuck apply); :class:`Run` is one submitted context from ``submit`` to its
last hook, its fate kept by the :class:`~waltz.client.lifecycle.Lifecycle` it extends. The core
(:mod:`waltz.client.core`) is the only code that changes them.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from waltz.client.config import ClientConfig
from waltz.client.context import TransactionContext
from waltz.client.dispatch import Where
from waltz.client.driver import MountState
from waltz.client.lifecycle import Lifecycle, State
from waltz.client.lock_queue import LockQueue
from waltz.client.monitor import TransactionMonitor
from waltz.client.transaction import Transaction
from waltz.errors import ClientError, TrimmedError
from waltz.protocol.records import ReqId

__all__ = ["PartitionState", "Run", "Slots", "Stuck"]

SUBMITTED = State.SUBMITTED


class Slots:
    """A counting semaphore with a timeout that never loses a slot to a cancellation (FIFO wake-up).

    :meth:`try_acquire` may be called from any thread (a callback thread takes a slot for the first attempt
    of a submit), and so may :meth:`wait_from_thread` (an application thread of the sync client waits there
    for room instead of on the loop); :meth:`acquire`, :meth:`release` and :meth:`wake_threads` only on the
    loop. Waiters on the loop come first: a thread is woken only when a slot is free and none waits there.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # Application threads waiting for a free slot.
        self._thread_waiters = 0  # How many (under _lock): release notifies only when one waits.
        # A thread was notified and has not returned from its wait yet (under _lock): the loop then wakes
        # nobody more; that thread wakes the next one if more slots are free (see wait_from_thread).
        self._waking = False

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits for one."""
        with self._lock:
            if self.used < self.limit and not self._waiters:
                self.used += 1
                return True
            return False

    @property
    def is_full(self) -> bool:
        """True if :meth:`try_acquire` would fail for want of a slot (a read, from any thread)."""
        return self.used >= self.limit or bool(self._waiters)

    def wait_from_thread(self, timeout_s: float) -> bool:
        """On an application thread (never the loop): wait up to ``timeout_s`` until a slot is free and no
        loop waiter waits for one, without taking it (the caller then races for it with
        :meth:`try_acquire`). Returns whether a slot is free as it returns (False: timed out, woken by
        :meth:`wake_threads`, or another caller took the slot first)."""
        with self._lock:
            if self._free():
                return True
            self._thread_waiters += 1
            try:
                self._room.wait(timeout_s)
            finally:
                self._thread_waiters -= 1
            self._waking = False
            # Wake-ups go from thread to thread, not one per slot from the loop: a burst of releases costs
            # the loop one notify, and each thread woken passes it on while more than its own slot is free.
            if self._thread_waiters and self.limit - self.used > 1 and not self._waiters:
                self._waking = True
                self._room.notify()
            return self._free()

    def wake_threads(self) -> None:
        """Wake every thread in :meth:`wait_from_thread` (the partition or the client is going away)."""
        with self._lock:
            self._waking = True
            self._room.notify_all()

    def _free(self) -> bool:
        return self.used < self.limit and not self._waiters

    async def acquire(self, timeout_s: float) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self.used < self.limit and not self._waiters:
                self.used += 1
                return
            self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # Granted just as we gave up: pass the slot on.
            else:
                waiter.cancel()
                with self._lock:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)  # Or it would keep try_acquire from taking free slots.
                        if self._thread_waiters and self._free() and not self._waking:
                            self._waking = True
                            self._room.notify()
            raise

    def release(self, count: int = 1) -> None:
        """Give back ``count`` slots (a feed run's committed appends give theirs back in one call)."""
        with self._lock:
            self.used -= count
            if not self._waiters:
                # The common case (once per append): nobody to wake on the loop, no list made; a thread of
                # the sync client may wait for this slot (woken unless one woken before has not run yet).
                if self._thread_waiters and not self._waking:
                    self._waking = True
                    self._room.notify()
                return
            granted: list[asyncio.Future[None]] = []
            while self._waiters and self.used < self.limit:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    self.used += 1
                    granted.append(waiter)
            if self._thread_waiters and not self._waking and self._free():
                self._waking = True  # Only cancelled waiters were left on the loop: a thread takes it.
                self._room.notify()
        for waiter in granted:
            waiter.set_result(None)


class PartitionState:
    """The client's state for one partition (event loop only)."""

    def __init__(self, partition_id: int, config: ClientConfig) -> None:
        self.id = partition_id
        self.slots = Slots(config.max_concurrent_transactions)
        # Committed transactions waiting for apply_transaction, at most feed_limit of them.
        self.feed: deque[Transaction] = deque()
        self.feed_limit = config.feed_queue_size
        self.monitor: TransactionMonitor | None = None  # Set once the application's HWM is known.
        self.state: MountState | None = None
        # The request ids of this partition's appends: the high half (the client id and the driver's
        # generation of the partition when it last became READY) and the partition's share of the low half
        # (its id; the append's sequence number fills the rest).
        self.req_msb = 0
        self.req_lsb_base = (partition_id & 0xFFFFFFFF) << 32
        self.error: ClientError | TrimmedError | None = None  # Set when released, closed or trimmed.
        self.outcomes: dict[ReqId, Run] = {}  # The appends in flight, by request id.
        # Runs appended on their first attempt whose transaction is not applied yet, in transaction-id order.
        self.awaiting_apply: deque[Run] = deque()
        self.tasks: list[asyncio.Task[Any]] = []  # Mount and applier tasks, cancelled on release.
        self.lock_queue = LockQueue()  # This client's contexts take turns on a write lock.
        self.stuck: Stuck | None = None  # Set while apply_transaction keeps failing on one transaction.
        self.resynced_at: float | None = None  # When the core last asked the driver to resync (its clock).
        # Made by the first waiter after a notify (see changed): notify, once per applied batch, then costs
        # nothing when nobody waits (no Event set and made each time).
        self._changed: asyncio.Event | None = None
        self._feed_waiter: asyncio.Future[None] | None = None  # The applier, waiting for the feed.
        self._loop: asyncio.AbstractEventLoop | None = None  # The applier's, once it waited.
        self._room_waiter: asyncio.Future[None] | None = None  # The driver, waiting for room in the feed.

    def push_feed_run(self, transactions: list[Transaction]) -> None:
        """Queue ``transactions`` for the applier, in order, with one wake-up."""
        self.feed.extend(transactions)
        waiter = self._feed_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def feed_waiter(self) -> asyncio.Future[None]:
        """A future the applier awaits while the feed is empty, resolved by the next :meth:`push_feed_run`."""
        loop = self._loop
        if loop is None:
            # Looked up once: asyncio.get_running_loop() costs a getpid() system call per call in 3.11.
            loop = self._loop = asyncio.get_running_loop()
        waiter = self._feed_waiter = loop.create_future()
        return waiter

    async def wait_room(self) -> None:
        while len(self.feed) >= self.feed_limit:
            self._room_waiter = asyncio.get_running_loop().create_future()
            await self._room_waiter

    def take_feed(self, max_count: int) -> list[Transaction]:
        feed = self.feed
        if len(feed) <= max_count:
            batch = list(feed)  # The common case, all of it: copied and cleared in C.
            feed.clear()
        else:
            batch = [feed.popleft() for _ in range(max_count)]
        waiter = self._room_waiter
        if waiter is not None and not waiter.done() and len(feed) < self.feed_limit:
            waiter.set_result(None)
        return batch

    def notify(self) -> None:
        """Wake everything waiting for a state or high-water-mark change."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def changed(self) -> None:
        """Return at the next :meth:`notify`."""
        event = self._changed
        if event is None:
            event = self._changed = asyncio.Event()
        await event.wait()


@dataclass(slots=True)
class Stuck:
    """A partition whose ``apply_transaction`` keeps failing on one transaction."""

    transaction_id: int
    error: Exception
    failures: int
    since: float  # client clock
    reminded_at: float

    def describe(self, partition_id: int, now: float) -> str:
        return (
            f"partition {partition_id} is stuck applying transaction {self.transaction_id}: "
            f"apply_transaction raised {type(self.error).__name__}: {self.error} "
            f"({self.failures} attempts in {now - self.since:.1f} s; "
            "uncaught_exception may return ApplyAction.SKIP, see docs/client.md)"
        )


class Run(Lifecycle):
    """One submitted context, from ``submit`` to its last hook. It IS the context's
    :class:`~waltz.client.lifecycle.Lifecycle` (``run.handle(event)``; the state machine still alone decides
    the context's fate): one object per append instead of two, and one attribute hop less per transition."""

    __slots__ = (
        "context",
        "data",
        "finished_waiter",
        "first_send",
        "partition",
        "transaction_id",
        "turn",
        "where",
    )

    def __init__(self, context: TransactionContext, where: Where) -> None:
        # Lifecycle.__init__'s two fields, set here (one call less per append).
        self.state = SUBMITTED
        self.attempts = 0
        self.context = context
        self.where = where  # Where its execute and hooks run (on the loop or a thread), decided at submit.
        self.partition: PartitionState | None = None  # Known once partition_id() returned.
        # Slow path only: resolved when the first append is sent (or the context ended).
        self.first_send: asyncio.Future[None] | None = None
        # Made on demand by done() (flush_transactions, for a run not finished yet), resolved by the core
        # when the run finishes.
        self.finished_waiter: asyncio.Future[None] | None = None
        self.transaction_id = -1  # Fast path, once committed.
        self.turn: asyncio.Future[None] | None = None  # Set while waiting in a lock queue.
        # ``data``: the data of the last append sent, set when it is sent (read only while it is in flight):
        # its committed transaction carries it (no fetch; see AttemptsMixin._resolve).
        self.data: bytes

    def done(self) -> asyncio.Future[None]:
        """A future resolved when the run is finished; only for a run that is not finished yet (one of the
        client's runs in flight)."""
        if self.finished_waiter is None:
            self.finished_waiter = asyncio.get_running_loop().create_future()
        return self.finished_waiter
