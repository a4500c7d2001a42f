"""A partition as served by its owning Waltz server: appends with optimistic locks, feeds, mounts, flushes.

Per partition there is one **append task** and one **feed task per mounted client**:

* The append task takes requests from a bounded queue in arrival order. For each it begins its locks in
  the lock table (waiting for in-flight appends when a slot is busy), rejects it with a LockFailure naming
  the lock high-water mark if the client computed it from stale state, and otherwise submits it to the
  store partition *in arrival order* (so a client's appends commit in the order it sent them, which its
  transaction monitor relies on). An append that finds the task idle and nothing queued is handled the same
  way at once by the connection's task, unless that would have to wait (a busy lock slot, a full store
  queue): it is then queued like any other. When the store commits it (the partition hears a committed batch
  in one call, inside the commit: :meth:`Partition.appends_committed`), the locks advance to its id, its
  header goes to the feed cache and its data to the transaction cache, and feeds wake up. A failed append
  sends nothing: the client learns it from the feed or a flush.
* A feed task streams ``(transaction id, header, request id)`` of every committed transaction after the
  client's high-water mark, in order, within the windows the client asks for (FeedRequest); a client that
  reads slowly only stalls its own feed task (we wait for its socket to drain).
* A mount first drains the append queue (so nothing of the client is pending here), then streams the
  transactions the client lacks and finishes with MountResponse(READY); a client whose high-water mark is
  above ours gets CLIENT_AHEAD (final for the client, so only from the incarnation of the generation the mount
  names, open, its store session open; any other answers NOT_READY and the client mounts again). A newer
  connection (connection sequence number) of the same client replaces the older one.

A partition object is one *incarnation*: it lives for one generation on this server, and its registrations
die with it. Nothing is dropped silently: :meth:`Partition.append`, :meth:`Partition.feed_request` and
:meth:`Partition.accepts_flush` return False for a request this incarnation cannot take (another generation, a
connection that is not the client's current mount here), and the caller tells the client to mount again
(MountResponse NOT_READY on its mount session). :meth:`Partition.close` tells every mounted client the same.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from waltz.errors import WaltzError
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.runtime import TaskSet
from waltz.server.feed_cache import FeedCache, FeedEntry
from waltz.server.locks import LockRequest, LockTable
from waltz.server.store.appends import PendingAppend
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache, TransactionData, TransactionFetcher

log = logging.getLogger(__name__)

_MASK32 = 0xFFFFFFFF
_monotonic = time.monotonic


class _NoSuchTransaction(Exception):
    """A load found no such transaction (the fetcher does not cache it; transaction_data answers None)."""


DEFAULT_MIN_FETCH_SIZE = 500
"""The smallest feed window (``server.minFetchSize``). Not the reference's 100: a client that keeps up gets
the smallest window every time, and each window costs a FeedSuspended, a FeedRequest and a feed task's
wake-up on both sides (every ~3 committed batches under load at 100), while any window up to
``FEED_WINDOW_MAX`` fits in what a client buffers per partition."""

FEED_BATCH = 64
"""Feed entries read from the cache or the store at a time (one feed-cache block)."""
FEED_READ_RETRY_S = 0.5
"""Pause before a feed reads again from a store whose read failed (after the store's own retries)."""


class Peer(Protocol):
    """The client connection a partition answers on (implemented by the server's connection state)."""

    @property
    def closed(self) -> bool: ...

    def send(self, msg: cs.Message) -> None: ...

    def send_feed(self, entries: Sequence[FeedEntry], frames: dict[int, bytes] | None = None) -> None:
        """A FeedData for each of ``entries`` (flat headers, see :class:`FeedEntry`), in order. ``frames``:
        the same entries already framed, by protocol version, shared by the peers one batch is sent to (a
        peer whose version is missing frames them and adds them)."""
        ...

    async def drain(self) -> None: ...

    @property
    def drain_needed(self) -> bool:
        """True if :meth:`drain` may have to wait (more of our frames unsent than the connection allows):
        a committed batch is then not sent from the commit, but by the feed task, which drains."""
        ...


@dataclass
class _Registration:
    peer: Peer
    generation: int
    seq_num: int
    session: ReqId
    """The MountRequest's ReqId: a MountResponse naming it ends the client's mount."""


@dataclass
class _Flush:
    future: asyncio.Future[int]


@dataclass(slots=True)
class _Append:
    peer: Peer
    msg: cs.AppendMessage
    received_s: float


class _AppendQueue(deque[_Append | _Flush]):
    """The append task's queue: arrival order, at most ``capacity`` items, waits as :class:`asyncio.Queue`
    (``put`` for room, ``get`` for an item). A deque itself, so the connection's read loop tests it for
    emptiness in C (``not queue``), once per append."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()

    def full(self) -> bool:
        return len(self) >= self.capacity

    def empty(self) -> bool:
        return not self

    def qsize(self) -> int:
        return len(self)

    def put_nowait(self, item: _Append | _Flush) -> None:
        """Queue ``item``; raises asyncio.QueueFull if there is no room."""
        if len(self) >= self.capacity:
            raise asyncio.QueueFull
        self.append(item)
        if len(self) == 1:
            # Only a getter that found the queue empty waits: the item that ends the emptiness wakes it.
            self._arrived.set()

    async def wait_room(self) -> None:
        """Return once the queue has room (at once if it has)."""
        while len(self) >= self.capacity:
            self._room.clear()
            await self._room.wait()

    async def put(self, item: _Append | _Flush) -> None:
        """Queue ``item``, waiting for room."""
        await self.wait_room()
        self.put_nowait(item)

    async def get(self) -> _Append | _Flush:
        while not self:
            self._arrived.clear()
            await self._arrived.wait()
        return self.get_nowait()

    def get_nowait(self) -> _Append | _Flush:
        """The oldest item; raises asyncio.QueueEmpty if there is none."""
        if not self:
            raise asyncio.QueueEmpty
        item = self.popleft()
        self._room.set()
        return item


@dataclass
class PartitionMetrics:
    """Hooks the server wires to Prometheus; plain callables keep this module free of the registry.

    Commits are reported once per batch (``appended(count, data_bytes)``, and the latency of the batch's first
    append): a Prometheus call per append costs a few percent of the server's time."""

    appended: Callable[[int, int], None] = lambda _count, _bytes: None
    lock_failed: Callable[[], None] = lambda: None
    failed: Callable[[], None] = lambda: None
    latency: Callable[[float], None] = lambda _s: None


@dataclass
class _FeedContext:
    peer: Peer
    client_id: int
    session: ReqId
    next_id: int
    remaining: int = 0
    mount_target: int | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class Partition:
    """One partition owned by this server (see the module docstring)."""

    def __init__(
        self,
        partition_id: int,
        store: StorePartition,
        *,
        feed_cache: FeedCache,
        transaction_cache: TransactionCache,
        lock_table_size: int = 30000,
        min_fetch_size: int = DEFAULT_MIN_FETCH_SIZE,
        append_queue_size: int = 1000,
        metrics: PartitionMetrics | None = None,
        fetcher: TransactionFetcher | None = None,
    ) -> None:
        self.partition_id = partition_id
        self.store = store
        self._feed_cache = feed_cache
        self._txn_cache = transaction_cache
        self._fetcher = fetcher
        """Shared by the server's partitions: bounds and coalesces store reads of transaction data."""
        self._lock_table_size = lock_table_size
        self._min_fetch_size = min_fetch_size
        self._queue = _AppendQueue(append_queue_size)
        self._registrations: dict[int, _Registration] = {}
        self._mounted: dict[int, Peer] = {}
        """The peer of each registration, keyed by the high half of the client's ReqId msb (its client id,
        unsigned): :meth:`append_nowait` checks an append's mount with one lookup of its raw msb."""
        self._generation32 = store.generation & _MASK32
        """The generation as the low half of a ReqId msb carries it (kept by :meth:`set_generation`)."""
        self._feeds: dict[int, _FeedContext] = {}
        self._locks: LockTable | None = None
        self._tasks = TaskSet(self._task_failed)
        """The append task and the feed tasks: a bug in one fails the partition (see :meth:`_failed`)."""
        self._loop_idle = False
        """True while the append task waits for an item with nothing queued (see :meth:`append`)."""
        self._ready = asyncio.Event()
        self._closed = False
        self.failure: BaseException | None = None
        """Why the append task or the store's supervisor died (a bug): the partition then takes no appends,
        and health says so."""
        self._failed_what = ""
        self.metrics = metrics or PartitionMetrics()
        self.on_failure: Callable[[Partition], None] | None = None
        """Called on the loop when the append task fails: the owner decides what becomes of the partition."""
        self.pending_appends = 0
        self._locked_pending = 0
        """Appends submitted by :meth:`_submit_now` with a lock request, not resolved yet: a committed batch
        looks for lock requests to commit only while there are some (plain appends skip that loop)."""
        self.lock_failures = 0

    # -- life cycle ------------------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self.store.generation

    @property
    def high_water_mark(self) -> int:
        return self.store.high_water_mark

    @property
    def is_healthy(self) -> bool:
        """True while the partition takes appends: its append task runs and its store session is open."""
        return self.problem is None

    @property
    def problem(self) -> str | None:
        """Why the partition takes no appends now, or None if it does."""
        if self._closed:
            return "closed"
        if self.failure is not None:
            return f"{self._failed_what} failed: {self.failure!r}"
        if not self.store.is_healthy:
            return "no open store session (recovering, or too few replicas reachable)"
        return None

    @property
    def is_ready(self) -> bool:
        """True once the first store session opened: from then on :attr:`high_water_mark` is the committed
        mark (before, it is -1 whatever the log holds)."""
        return self._ready.is_set()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    @property
    def is_serving(self) -> bool:
        """True while reads are answered: the partition is ready and its store session is open. A partition
        whose session ended (quorum lost, fenced) still knows its last mark, but no longer whether it is the
        log's end, nor can it read below it: it must not answer as if it did."""
        return self._ready.is_set() and self.store.is_healthy

    async def wait_serving(self) -> None:
        """Wait until :attr:`is_serving` (raises ClosedResourceError if the store closes meanwhile)."""
        await self._ready.wait()
        await self.store.wait_open()

    @property
    def feed_context_count(self) -> int:
        return len(self._feeds)

    async def start(self) -> None:
        self.store.on_failure = self._store_failed
        await self.store.start()
        self._tasks.spawn(self._append_loop(), f"append-{self.partition_id}", self._append_task_failed)

    def _append_task_failed(self, _task: asyncio.Task[Any], error: BaseException) -> None:
        # The append task ends only by cancellation (close): anything else is a bug that leaves the partition
        # unable to append. Said once, loudly; health reports it and the owner hears of it (the server
        # reopens the partition).
        if not self._closed:
            self._failed("the append task", error)

    def _task_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        # A feed task ends by cancellation or on a WaltzError it handles: anything else is a bug, and the
        # partition fails as for a failed append task.
        if not self._closed:
            self._failed(f"the feed task {task.get_name()}", error)

    def _store_failed(self, error: BaseException) -> None:
        # The store partition's supervisor died (a bug): as for the append task, the owner hears of it.
        if not self._closed:
            self._failed("the store", error)

    def _failed(self, what: str, error: BaseException) -> None:
        if self.failure is not None:
            return
        self.failure = error
        self._failed_what = what
        log.error(
            "partition %d: %s failed; the partition takes no appends", self.partition_id, what, exc_info=error
        )
        if self.on_failure is not None:
            self.on_failure(self)

    async def close(self) -> None:
        """Stop the tasks, end feeds, tell every mounted client to mount again, close the store partition."""
        self._closed = True
        # Without this a client whose connection stays up would keep talking to an incarnation that is gone.
        for reg in self._registrations.values():
            if not reg.peer.closed:
                reg.peer.send(cs.MountResponse(reg.session, cs.PartitionState.NOT_READY))
        self._registrations.clear()
        self._mounted.clear()
        for ctx in list(self._feeds.values()):
            self._end_feed(ctx)
        await self._tasks.aclose()  # Feeds replaced meanwhile included.
        self._feeds.clear()
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, _Flush) and not item.future.done():
                item.future.cancel()
        await self.store.close()
        self._feed_cache.evict_partition(self.partition_id)

    def set_generation(self, generation: int) -> None:
        self.store.set_generation(generation)
        self._generation32 = self.store.generation & _MASK32

    # -- entry points (called by the connection handler, in the connection's message order) -----------------

    def _is_current(self, peer: Peer, req_id: ReqId) -> bool:
        reg = self._registrations.get(req_id.client_id)
        return reg is not None and reg.peer is peer

    def accepts(self, peer: Peer, req_id: ReqId) -> bool:
        """Whether an append from ``peer`` belongs to this incarnation: the current mount of its client, in
        this generation. If not, the caller must tell the client to mount again."""
        return (
            not self._closed and req_id.generation == self.store.generation and self._is_current(peer, req_id)
        )

    def accepts_flush(self, peer: Peer, req_id: ReqId) -> bool:
        """Whether a flush from ``peer`` belongs to this incarnation: the current mount of its client. A
        flush names the client's last pending append, which may have been sent in an earlier generation (it
        asks "resolve everything up to it"), so its generation is not checked."""
        return not self._closed and self._is_current(peer, req_id)

    def append_nowait(self, peer: Peer, msg: cs.AppendMessage, more: bool = False) -> bool | None:
        """:meth:`append` if that needs no wait: True if taken (handed to the store, queued for the append
        task, or answered with a LockFailure), False if this incarnation cannot take it (see :meth:`accepts`),
        None (nothing done) if it would have to wait for room in the append queue: then call :meth:`append`.
        The connection's read loop calls this first: no coroutine per append.

        ``more=True`` says more requests were read with this one and are handled next, in this same callback
        (see ``StorePartition.submit``): an idle store writer then waits for the last of them and
        sends them as one batch, instead of sending this one alone at once."""
        # accepts(), on the ReqId's raw msb (client id << 32 | generation): one dict lookup, no properties.
        msb = msg.req_id[0]
        if self._mounted.get(msb >> 32) is not peer or msb & _MASK32 != self._generation32 or self._closed:
            return False
        received_s = _monotonic()
        queue = self._queue
        if self._loop_idle and not queue and self._submit_now(peer, msg, received_s, more):
            return True
        # It has to wait (appends queued ahead of it, or a busy lock slot): queue it here, as append() would,
        # unless the queue is full (append() waits for room). After a busy slot, every append behind it comes
        # this way until the queue drains: no coroutine and no second accepts() or lock attempt for each.
        if queue.full():
            return None
        queue.put_nowait(_Append(peer, msg, received_s))
        return True

    def end_burst(self) -> None:
        """The appends this partition took with ``more=True`` are the last of their read: they go now."""
        self.store.end_burst()

    async def append(self, peer: Peer, msg: cs.AppendMessage) -> bool:
        """:meth:`append_nowait`, waiting for room in the append queue while it is full (back pressure on that
        connection); False if this incarnation cannot take it (see :meth:`accepts`)."""
        while True:
            taken = self.append_nowait(peer, msg)
            if taken is not None:
                return taken
            await self._queue.wait_room()

    async def flush(self) -> int:
        """Wait until every append queued before this call is resolved; return the high-water mark."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Flush(fut))
        return await fut

    async def flush_request(self, peer: Peer, msg: cs.FlushRequest) -> None:
        """Answer a flush accepted by :meth:`accepts_flush` once every append before it is resolved, through
        an open store session: the client takes the answer as final, and a store fenced by a new owner fails
        the appends it had in flight though that owner's recovery may have committed them. Such a flush waits
        for a session that never opens, until :meth:`close` tells the client to mount again."""
        while not self._closed:  # once closed, close() has told the client to mount again
            await self.store.wait_open()  # raises ClosedResourceError once the store is closed
            hwm = await self.flush()
            if self.store.is_healthy and not self._closed:
                peer.send(cs.FlushResponse(msg.req_id, hwm))
                return

    def _answers_mount(self, generation: int) -> bool:
        """Whether a mount naming ``generation`` is ours to answer: only while open, in that generation (an
        older incarnation, fenced or not yet replaced, may know a mark far below the log's end)."""
        return generation == self.generation and not self._closed

    async def mount(self, peer: Peer, msg: cs.MountRequest) -> None:
        """Stream what the client lacks, then READY; CLIENT_AHEAD only with the store session open (the mark
        is the log's end); NOT_READY if not ours to answer (:meth:`_answers_mount`)."""
        rid = msg.req_id
        if not self._answers_mount(rid.generation):
            peer.send(cs.MountResponse(rid, cs.PartitionState.NOT_READY))
            return
        reg = self._registrations.get(rid.client_id)
        if reg is not None and reg.peer is not peer:
            newer = (rid.generation, msg.seq_num) >= (reg.generation, reg.seq_num)
            if not newer:
                # A mount from a superseded connection of this client: that connection is over.
                peer.send(cs.MountResponse(rid, cs.PartitionState.NOT_READY))
                return
        self._registrations[rid.client_id] = _Registration(peer, rid.generation, msg.seq_num, rid)
        self._mounted[rid.msb >> 32] = peer
        old = self._feeds.pop(rid.client_id, None)
        if old is not None:
            self._end_feed(old)
        await self._ready.wait()
        if self._closed:
            return  # close() answered NOT_READY; a flush would wait for the append task it ended
        hwm = await self.flush()
        reg = self._registrations.get(rid.client_id)
        if reg is None or reg.peer is not peer:
            return
        if reg.session != rid:
            # A later MountRequest of this connection registered while this one waited: that one is the
            # client's mount now and starts the feed. Starting ours too would leave one of the two feed
            # tasks parked with nothing that ends it.
            peer.send(cs.MountResponse(rid, cs.PartitionState.NOT_READY))
            return
        if msg.client_high_water_mark > hwm:
            if not (self._answers_mount(rid.generation) and self.store.is_healthy):
                # Closed meanwhile, or no open store session (quorum lost, fenced by a new owner): our mark
                # may not be the log's end, and CLIENT_AHEAD is final for a client.
                peer.send(cs.MountResponse(rid, cs.PartitionState.NOT_READY))
                return
            peer.send(cs.MountResponse(rid, cs.PartitionState.CLIENT_AHEAD))
            log.warning(
                "partition %d: client %d is ahead (%d > %d)",
                self.partition_id,
                rid.client_id,
                msg.client_high_water_mark,
                hwm,
            )
            return
        ctx = _FeedContext(peer, rid.client_id, rid, msg.client_high_water_mark + 1, mount_target=hwm)
        self._start_feed(ctx)

    def feed_request(self, peer: Peer, msg: cs.FeedRequest) -> bool:
        """Open the next feed window; False if the request names no current feed session of its client (the
        caller answers NOT_READY on that session, which the client ignores unless it is still its own)."""
        ctx = self._feeds.get(msg.req_id.client_id)
        if ctx is None or ctx.peer is not peer or ctx.session != msg.req_id:
            return False
        if ctx.mount_target is not None:
            return True  # still catching up for the mount; the client asks again after READY
        ctx.next_id = msg.client_high_water_mark + 1
        # Capped: a window is what the client buffers for the partition without pausing its connection (see
        # FEED_WINDOW_MAX), so a client behind by more than that gets its backlog a window per round trip.
        lag = self.high_water_mark - msg.client_high_water_mark
        ctx.remaining = max(self._min_fetch_size, min(lag, cs.FEED_WINDOW_MAX))
        ctx.wake.set()
        return True

    def disconnect(self, peer: Peer) -> None:
        """Forget a closed connection: its registration and its feed."""
        for client_id, reg in list(self._registrations.items()):
            if reg.peer is peer:
                del self._registrations[client_id]
                del self._mounted[reg.session.msb >> 32]
                ctx = self._feeds.get(client_id)
                if ctx is not None and ctx.peer is peer:
                    del self._feeds[client_id]
                    self._end_feed(ctx)

    async def transaction_data(self, transaction_id: int) -> tuple[bytes, int] | None:
        """The data and checksum of a committed transaction, or None if there is no such transaction; raises
        TrimmedError below the trim point (even for a transaction still cached)."""
        self.store.check_trim(transaction_id)
        cached = self._txn_cache.get(self.partition_id, transaction_id)
        if cached is not None:
            return cached.data, cached.checksum
        if transaction_id > self.high_water_mark or transaction_id < 0:
            return None
        if self._fetcher is None:
            try:
                found = await self.load_transaction(transaction_id)
            except _NoSuchTransaction:
                return None
            self._txn_cache.put(self.partition_id, transaction_id, found.data, found.checksum)
            return found.data, found.checksum
        try:
            found = await self._fetcher.fetch(self.partition_id, transaction_id)
        except _NoSuchTransaction:
            return None
        return found.data, found.checksum

    async def load_transaction(self, transaction_id: int) -> TransactionData:
        """Read a committed transaction from the store (the fetcher's loader for this partition)."""
        record = await self.store.read_record(transaction_id)
        if record is None:
            raise _NoSuchTransaction(transaction_id)
        return TransactionData(record.data, record.checksum)

    # -- the append task -------------------------------------------------------------------------------------

    async def _append_loop(self) -> None:
        hwm = await self.store.wait_open()
        # Every slot starts at the high-water mark: a lock's last writer is unknown, so any client that has
        # not seen everything up to here conflicts (never a false negative).
        self._locks = LockTable(self._lock_table_size, hwm)
        self._ready.set()
        queue = self._queue
        while True:
            if queue.empty():
                self._loop_idle = True
                try:
                    item = await queue.get()
                finally:
                    self._loop_idle = False
            else:
                item = queue.get_nowait()
            if isinstance(item, _Flush):
                try:
                    hwm = await self.store.flush()
                except WaltzError:
                    hwm = self.high_water_mark
                if not item.future.done():
                    item.future.set_result(hwm)
                continue
            if item.peer.closed or not self._is_current(item.peer, item.msg.req_id):
                continue
            # More queued behind it: the store waits for them (up to the last this loop hands over without
            # waiting) and sends them as one batch rather than this one alone.
            if not self._submit_now(item.peer, item.msg, item.received_s, bool(queue)):
                await self._process_append(item)

    def _submit_now(
        self,
        peer: Peer,
        msg: cs.AppendMessage,
        received_s: float,
        more: bool = False,
        held: LockRequest | None = None,
    ) -> bool:
        """Hand an append to the store if that needs no wait: True if queued, refused (its locks released) or
        answered with a LockFailure; False (nothing done) if it would have to wait for a lock slot or for room
        in the store's queue. Its end is heard in :meth:`appends_committed` (with the rest of its batch) or
        :meth:`append_failed`. ``more`` as in :meth:`append_nowait`.

        ``held``: its locks, begun and checked by the caller (:meth:`_process_append`, which waited for a
        slot), and kept when the queue is full; without them the locks are begun and checked here."""
        req = held
        if held is None and (msg.write_locks or msg.read_locks or msg.append_locks):
            locks = self._locks
            if locks is None:
                return False
            # Begin and check in one call; a conflicting request takes nothing, so has nothing to release.
            begun = locks.begin_checked(
                msg.write_locks, msg.read_locks, msg.append_locks, msg.client_high_water_mark
            )
            if begun is None:
                return False
            if isinstance(begun, int):
                self._lock_failed(peer, msg, begun)
                return True
            req = begun
        self.pending_appends += 1
        try:
            # The codec verified the data against its checksum as it decoded the request (see
            # cs.decode_append_request): the store need not compute it again.
            queued = self.store.submit(msg, self, req, received_s, more)
        except WaltzError as e:
            self.pending_appends -= 1
            self._refused(req, msg, e)
            return True
        if not queued:
            self.pending_appends -= 1
            if held is None:
                self._release(req)
            return False
        if req is not None:
            self._locked_pending += 1
        return True

    async def _process_append(self, item: _Append) -> None:
        """:meth:`_submit_now`, waiting for a lock slot and for room in the store's queue where it must."""
        msg = item.msg
        req: LockRequest | None = None
        # An append without locks can neither conflict nor invalidate another: it skips the lock table.
        if msg.write_locks or msg.read_locks or msg.append_locks:
            req = await self._take_locks(item)
            if req is None:
                return
        while not self._submit_now(item.peer, msg, item.received_s, False, req):
            await self.store.wait_room()

    def _refused(self, req: LockRequest | None, msg: cs.AppendMessage, error: WaltzError) -> None:
        self._release(req)
        self.metrics.failed()
        log.debug("partition %d: append %r refused: %s", self.partition_id, msg.req_id, error)

    async def _take_locks(self, item: _Append) -> LockRequest | None:
        """Begin the append's locks and check them; None (with a LockFailure sent) if they conflict."""
        locks = self._locks
        assert locks is not None
        msg = item.msg
        req = locks.begin(msg.write_locks, msg.read_locks, msg.append_locks)
        if req is None:
            # A slot is held by an in-flight append: retry after each resolution of the store, so the wait
            # ends as soon as that append is resolved (append_failed and appends_committed release its
            # slots synchronously, inside the resolution), not when everything in flight is (a full
            # replication round trip later, with the whole append queue stalled behind it). Nothing is
            # submitted while we wait (this task is the only submitter while it is busy), so the unresolved
            # appends only decrease: the loop ends.
            # The order of appends is kept: this append is still the next one submitted.
            store = self.store
            while await store.wait_resolution():
                req = locks.begin(msg.write_locks, msg.read_locks, msg.append_locks)
                if req is not None:
                    break
        if req is None:
            # Every append is resolved and the slot is still busy. The yield is a safety margin for anything
            # else the resolutions scheduled before we conclude that slots leaked: a reset makes every
            # in-flight append fail its lock check.
            await asyncio.sleep(0)
            req = locks.begin(msg.write_locks, msg.read_locks, msg.append_locks)
            if req is None:
                log.warning(
                    "partition %d: lock slots busy with nothing pending; resetting", self.partition_id
                )
                locks.reset(self.high_water_mark)
                req = locks.begin(msg.write_locks, msg.read_locks, msg.append_locks)
                if req is None:
                    raise AssertionError("lock table refused a request right after a reset")
        return req if self._check_locks(item, req) else None

    def _check_locks(self, item: _Append, req: LockRequest) -> bool:
        """Check the begun locks of ``item``; on a conflict release them, send a LockFailure, return False."""
        locks = self._locks
        assert locks is not None
        msg = item.msg
        conflict = locks.check(req, msg.client_high_water_mark)
        if conflict is not None:
            locks.release(req)
            self._lock_failed(item.peer, msg, conflict)
            return False
        return True

    def _lock_failed(self, peer: Peer, msg: cs.AppendMessage, conflict: int) -> None:
        self.lock_failures += 1
        self.metrics.lock_failed()
        peer.send(cs.LockFailure(msg.req_id, conflict))

    def _release(self, req: LockRequest | None) -> None:
        if req is not None:
            locks = self._locks
            assert locks is not None
            locks.release(req)

    def appends_committed(self, appends: Sequence[PendingAppend]) -> None:
        """AppendListener: appends this partition submitted committed (a batch, in id order, inside the
        store's commit): locks advance to each id, headers go to the feed cache and data to the transaction
        cache a batch at a time, the feeds wake once."""
        n = len(appends)
        if not n:
            return
        self.pending_appends -= n
        if self._locked_pending:
            locks = self._locks
            for pending in appends:
                req = pending.tag
                if req is not None:
                    assert locks is not None  # a lock request was begun in it
                    locks.commit_and_release(req, pending.transaction_id)  # type: ignore[arg-type]
                    self._locked_pending -= 1
        pid = self.partition_id
        self._feed_cache.add_run(pid, appends)
        data_bytes = self._txn_cache.put_run(pid, appends)
        if self._feeds:
            self._feed_batch(appends)
        # Counted here, one latency sample per batch (its first append's stands for the batch): two additions
        # and a bisect cost less than a callback scheduled per partition and loop iteration to report them
        # (with many partitions nearly every batch is alone in its iteration).
        metrics = self.metrics
        metrics.appended(n, data_bytes)
        metrics.latency(_monotonic() - appends[0].received_s)

    def _feed_batch(self, appends: Sequence[PendingAppend]) -> None:
        """A committed batch for every feed: sent here, from the commit, to each feed that is live at its
        first id (every earlier id sent, the batch within its window, nothing backlogged on its
        connection); the others' tasks are woken to send from the cache as before. The feed task stays the
        one that catches up, waits for windows and drains: this only saves it a wake-up, a cache lookup and
        a loop iteration per batch while it would have sent exactly these entries next (ids in order, each
        once: ``next_id`` says what was sent, whoever sent it)."""
        n = len(appends)
        first = appends[0].transaction_id
        # Dense ids only: a batch the store shared with appends of another listener reaches here with gaps,
        # which only the feed task fills.
        dense = appends[-1].transaction_id == first + n - 1
        entries: list[FeedEntry] | None = None
        frames: dict[int, bytes] = {}  # Framed once per protocol version, not once per client.
        for ctx in self._feeds.values():
            peer = ctx.peer
            if (
                not dense
                or ctx.next_id != first
                or ctx.mount_target is not None
                or n > ctx.remaining
                or n > FEED_BATCH
                or peer.closed
                or peer.drain_needed
            ):
                ctx.wake.set()
                continue
            if entries is None:
                entries = [(p.transaction_id, p.req_id[0], p.req_id[1], p.header) for p in appends]
            peer.send_feed(entries, frames)
            ctx.next_id = first + n
            ctx.remaining -= n
            if ctx.remaining <= 0:
                peer.send(cs.FeedSuspended(ctx.session))

    def append_failed(self, append: PendingAppend, error: BaseException) -> None:
        """AppendListener: an append this partition submitted will not commit (the client learns it
        from the feed or a flush: nothing is sent)."""
        self.pending_appends -= 1
        if append.tag is not None:
            self._locked_pending -= 1
            self._release(append.tag)  # type: ignore[arg-type]
        self.metrics.failed()

    # -- feeds -----------------------------------------------------------------------------------------------

    def _start_feed(self, ctx: _FeedContext) -> None:
        # One feed task per client: one it replaces would otherwise wait for a wake-up nobody sends.
        old = self._feeds.get(ctx.client_id)
        if old is not None:
            self._end_feed(old)
        self._feeds[ctx.client_id] = ctx
        ctx.task = self._tasks.spawn(self._feed_loop(ctx), f"feed-{self.partition_id}-client-{ctx.client_id}")

    def _end_feed(self, ctx: _FeedContext) -> None:
        if ctx.task is not None and ctx.task is not asyncio.current_task():
            ctx.task.cancel()

    async def _headers(self, start: int, count: int, cached: list[FeedEntry]) -> list[FeedEntry]:
        """``count`` headers from ``start``: ``cached`` (fewer, what the feed cache had from there), then the
        rest read from the store (fewer if the store cannot serve them now)."""
        more = await self.store.read_headers(start + len(cached), count - len(cached))
        if more:
            self._feed_cache.fill(self.partition_id, more)
        cached.extend((h.transaction_id, h.req_id.msb, h.req_id.lsb, h.header) for h in more)
        return cached

    async def _feed_limit(self, ctx: _FeedContext) -> int | None:
        """The last id the feed may send now (at least ``ctx.next_id``); or None once it has waited (for a
        window or a commit) or answered a mount caught up with READY, so the feed loop looks again."""
        if ctx.mount_target is not None:
            limit = ctx.mount_target
        elif ctx.remaining > 0:
            limit = min(self.high_water_mark, ctx.next_id + ctx.remaining - 1)
        else:
            ctx.wake.clear()
            await ctx.wake.wait()
            return None
        if ctx.next_id > limit:
            if ctx.mount_target is not None:
                ctx.mount_target = None
                ctx.remaining = 0
                ctx.peer.send(cs.MountResponse(ctx.session, cs.PartitionState.READY))
                return None
            ctx.wake.clear()
            if ctx.next_id > self.high_water_mark:
                await ctx.wake.wait()  # long poll: wait for a commit
            return None
        return limit

    async def _feed_loop(self, ctx: _FeedContext) -> None:
        peer = ctx.peer
        read_failed = False  # The last store read failed (logged once until one succeeds).
        try:
            while not peer.closed:
                limit = await self._feed_limit(ctx)
                if limit is None:
                    continue
                start = ctx.next_id
                count = min(limit - start + 1, FEED_BATCH)
                headers = self._feed_cache.get_entries(self.partition_id, start, count)
                if len(headers) < count:
                    # Not all in the cache (a reader behind it): the rest comes from the store.
                    try:
                        headers = await self._headers(start, count, headers)
                    except WaltzError as e:
                        # The store gave up for now (storage unreachable for seconds, its session reopening):
                        # read again. Ending the feed here would stall the client for good: it waits on an
                        # open connection for the rest of its window, and a reader that appends nothing
                        # never times out.
                        if not read_failed:
                            log.warning(
                                "partition %d: feed of client %d cannot read transaction %d from the store "
                                "(trying again): %s",
                                self.partition_id,
                                ctx.client_id,
                                start,
                                e,
                            )
                        read_failed = True
                        await asyncio.sleep(FEED_READ_RETRY_S)
                        continue
                    if read_failed:
                        read_failed = False
                        log.info(
                            "partition %d: feed of client %d reads from the store again",
                            self.partition_id,
                            ctx.client_id,
                        )
                    if ctx.next_id != start:
                        # Moved while we read: a FeedRequest restarted the window elsewhere, or a commit was
                        # sent live (_feed_batch). What we read no longer follows what was sent: read again.
                        continue
                if not headers:
                    await asyncio.sleep(0.01)  # the store cannot serve it right now; try again shortly
                    continue
                peer.send_feed(headers)
                ctx.next_id += len(headers)
                if ctx.mount_target is None:
                    ctx.remaining -= len(headers)
                    if ctx.remaining <= 0:
                        peer.send(cs.FeedSuspended(ctx.session))
                # A slow reader stalls only its own feed.
                await peer.drain()
        except WaltzError as e:
            log.debug("partition %d: feed of client %d ended: %s", self.partition_id, ctx.client_id, e)
        finally:
            if self._feeds.get(ctx.client_id) is ctx:
                del self._feeds[ctx.client_id]
