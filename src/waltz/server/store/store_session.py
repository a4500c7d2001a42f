"""A store session: one numbered attempt to write the partition through a fixed set of replicas.

A session is created with a session id already taken by a version-checked ZooKeeper write (see
``store_partition.py``). :meth:`StoreSession.run`:

1. starts one :class:`ReplicaSession` task per replica of the current set (they connect, fence older sessions,
   and recover);
2. waits until the previous session's closing high-water mark is resolved and a quorum of the *current* set
   has recovered, then writes the new replica states to ZooKeeper (version-checked: if another server took the
   partition meanwhile, this session ends without writing anything);
3. opens with low-water mark = high-water mark = the resolved mark: appends of a failed earlier session are
   now resolved against it by the host (ids at or below it succeeded if the stored record is theirs);
4. runs the single writer loop: take up to ``max_batch_size`` queued appends, give them the next dense ids,
   and send the batch to every participant, keeping up to ``max_inflight_batches`` batches in flight (a batch
   joins others in flight only if it is full). A batch commits once a quorum of the current set has fsynced
   it *and* every earlier batch has committed: the high-water mark only moves in order, so everything below
   the oldest batch in flight is committed.

Any participant failure or abstention, a fencing error, a lost quorum, the checkpoint interval, a replica-set
change or closing ends the session; :meth:`run` then returns a :class:`SessionOutcome`. The session's tasks
are owned by it, cancelled and awaited before :meth:`run` returns. A bug inside a task (an exception that is
not a :class:`~waltz.errors.WaltzError` the task handles) ends the session and is re-raised by :meth:`run`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.errors import (
    BrokenResourceError,
    ConcurrentUpdateError,
    CorruptionError,
    SessionFencedError,
    WaltzError,
)
from waltz.protocol.record_run import RunBytes
from waltz.protocol.records import Record, RecordHeader, ReqId
from waltz.server.store.interfaces import PartitionMetadataStore, ReplicaConnection, ReplicaConnector
from waltz.server.store.recovery import RecoveryState, metadata_after_recovery, metadata_with_clean_replica
from waltz.server.store.replica_session import Batch, ReplicaRole, ReplicaSession, SessionOver
from waltz.server.store.support import InvariantViolation, RepairStatistics, StoreConfig, TaskList
from waltz.server.store.voting import Voting, quorum_of

__all__ = [
    "AppendListener",
    "AppendQueue",
    "EndReason",
    "PendingAppend",
    "SessionHost",
    "SessionOutcome",
    "StoreSession",
]

log = logging.getLogger(__name__)

_tuple_new = tuple.__new__

T = TypeVar("T")

REPAIR_MAX_RECORDS = 10_000
"""Records one background repair copies at most (one read's range; the node caps what one read returns)."""
MAX_DAMAGED_IDS = 1000
"""Damaged ids one poll asks a replica for (a storage node remembers at most this many per partition)."""
REPAIR_RETRY_POLLS = 6
"""After a failed repair of damage a replica reported, this many of its polls are skipped before the next try
(so a record no participant holds a good copy of costs a warning a minute, not one per poll)."""


class EndReason(enum.Enum):
    REPLICA_FAILED = "replica failed"
    FENCED = "fenced by a newer session"
    QUORUM_LOST = "quorum lost"
    CHECKPOINT = "checkpoint interval reached"
    REPLICAS_CHANGED = "replica set changed"
    CLOSED = "closed"
    METADATA_CONFLICT = "partition metadata changed by someone else"
    METADATA_UNAVAILABLE = "partition metadata unavailable"
    INTERNAL_ERROR = "internal error"


@dataclass(frozen=True)
class SessionOutcome:
    """How a session ended, and whether it had opened (recovered and written its metadata)."""

    session_id: int
    reason: EndReason
    detail: str
    opened: bool


@dataclass(eq=False, slots=True)
class PendingAppend:
    """One append waiting for its transaction id. ``transaction_id`` is -1 until a batch assigns one."""

    req_id: ReqId
    header: int
    data: bytes
    checksum: int
    future: asyncio.Future[int] | None
    """What :meth:`StorePartition.submit` returns; None for a caller that learns the outcome from
    ``on_resolved`` alone."""
    ticket: int
    """Its place in submission order (the host's bookkeeping)."""
    transaction_id: int = -1
    session_id: int = -1
    resolved: bool = False
    """The store decided its fate (it succeeded or failed), whether or not its caller still waits."""
    on_resolved: Callable[[int, BaseException | None], None] | None = None
    """Called once, synchronously, when the append is resolved: ``(transaction id, None)`` or ``(-1, error)``.
    Used instead of a callback on :attr:`future`, which would run one event-loop iteration later."""
    listener: AppendListener | None = None
    """For an append submitted with :meth:`StorePartition.submit_tagged`: told of its resolution together
    with the other appends of its batch (one call per batch, the server's hot path), instead of
    ``on_resolved``."""
    tag: object = None
    """What the submitter attached (the server's partition: the append's lock request); the store never
    looks at it."""
    received_s: float = 0.0
    """When the submitter received the append (``time.monotonic()``), for its latency metric."""

    def record(self) -> Record:
        # Record(...) without its generated __new__: one per append on the write path.
        return _tuple_new(Record, (self.transaction_id, self.req_id, self.header, self.data, self.checksum))

    def succeed(self, transaction_id: int) -> None:
        first = not self.resolved
        self.resolved = True
        future = self.future
        if future is not None and not future.done():
            future.set_result(transaction_id)
        if first:
            if self.on_resolved is not None:
                _notify(self.on_resolved, transaction_id, None)
            elif self.listener is not None:
                _notify_committed(self.listener, (self,))

    def fail(self, error: BaseException) -> None:
        first = not self.resolved
        self.resolved = True
        future = self.future
        if future is not None and not future.done():
            future.set_exception(error)
            # The caller may have stopped waiting (cancelled); do not let asyncio warn about the exception.
            future.exception()
        if first:
            if self.on_resolved is not None:
                _notify(self.on_resolved, -1, error)
            elif self.listener is not None:
                try:
                    self.listener.append_failed(self, error)
                except Exception:
                    log.exception("an append's resolution listener failed")


class AppendListener(Protocol):
    """Hears how appends submitted with :meth:`StorePartition.submit_tagged` end, synchronously, in id order.

    Each append is reported exactly once: committed (its ``transaction_id`` set) or failed."""

    def appends_committed(self, appends: Sequence[PendingAppend]) -> None:
        """``appends`` committed (consecutive ids, oldest first): usually a whole batch in one call."""
        ...

    def append_failed(self, append: PendingAppend, error: BaseException) -> None:
        """``append`` did not commit, and never will."""
        ...


def _notify_committed(listener: AppendListener, appends: Sequence[PendingAppend]) -> None:
    # As _notify: a failing listener is logged, and the store's bookkeeping goes on.
    try:
        listener.appends_committed(appends)
    except Exception:
        log.exception("an append's resolution listener failed")


def _notify(
    on_resolved: Callable[[int, BaseException | None], None], transaction_id: int, error: BaseException | None
) -> None:
    # A failing listener must not break the store's bookkeeping (it runs inside a commit): log it, as the
    # event loop logs a failing future callback.
    try:
        on_resolved(transaction_id, error)
    except Exception:
        log.exception("an append's resolution listener failed")


class AppendQueue:
    """The appends waiting for ids, oldest first, at most ``capacity`` of them.

    Unlike :class:`asyncio.Queue`, a producer waiting for room gives up, without putting its append, once the
    store has resolved it (failed it: the partition closed or moved), so a failed partition never leaves
    producers stuck, and the writer never sees an append that already failed.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._items: deque[PendingAppend] = deque()
        self.data_bytes = 0
        """Bytes of data queued (a batch is full by count or by bytes)."""
        self._room = asyncio.Event()
        self._room.set()
        self._arrived = asyncio.Event()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return len(self._items) >= self.capacity

    async def put(self, append: PendingAppend) -> None:
        """Queue ``append``, waiting for room unless (or until) it is resolved."""
        while len(self._items) >= self.capacity:
            self._room.clear()
            await self._room.wait()
            if append.resolved:
                return
        self.put_nowait(append)

    def put_nowait(self, append: PendingAppend) -> None:
        """Queue ``append`` now; the caller checked that the queue is not :meth:`full`."""
        if len(self._items) >= self.capacity:
            raise InvariantViolation(f"append queue full ({self.capacity})")
        items = self._items
        items.append(append)
        self.data_bytes += len(append.data)
        if len(items) == 1:
            # Only a getter that found the queue empty waits (after clearing the event): the append that
            # ends the emptiness wakes it, those after it need not (Event.set is a Python call per append).
            self._arrived.set()

    async def get(self) -> PendingAppend:
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        return self.get_nowait()

    async def wait_arrived(self) -> None:
        """Return at once if an append is queued, else once one was queued (it may have been taken since:
        the store session's writer then checks again what to do)."""
        if not self._items:
            self._arrived.clear()
            await self._arrived.wait()

    def peek(self) -> PendingAppend | None:
        """The oldest queued append, left in the queue (None if empty)."""
        return self._items[0] if self._items else None

    def offer(self, append: PendingAppend) -> int:
        """Queue ``append`` if there is room: how many appends are queued now, 0 if none was (full). One
        call where :meth:`full` and :meth:`put_nowait` are two (the server's hot path)."""
        items = self._items
        n = len(items)
        if n >= self.capacity:
            return 0
        items.append(append)
        self.data_bytes += len(append.data)
        if not n:
            # As put_nowait: the append that ends the emptiness wakes a getter.
            self._arrived.set()
        return n + 1

    def get_nowait(self) -> PendingAppend:
        append = self._items.popleft()
        self.data_bytes -= len(append.data)
        self._room.set()
        return append

    def take_more(self, batch: list[PendingAppend], size: int, max_count: int, max_bytes: int) -> int:
        """Move the oldest queued appends onto ``batch`` (holding ``size`` data bytes) while it has fewer than
        ``max_count`` and the next one fits in ``max_bytes``; return the batch's data bytes.

        One call per batch rather than a :meth:`peek` and :meth:`get_nowait` per append: forming batches is
        per-record work on the write path."""
        items = self._items
        room = max_count - len(batch)
        if len(items) <= room and size + self.data_bytes <= max_bytes:
            # Everything queued fits (the common case under a steady load): take it in one C call.
            batch.extend(items)
            items.clear()
            size += self.data_bytes
            self.data_bytes = 0
            self._room.set()
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
        self._room.set()
        return size

    def clear(self) -> None:
        """Drop every queued append and wake the producers waiting for room (to queue theirs, or give up if
        it was resolved meanwhile)."""
        self._items.clear()
        self.data_bytes = 0
        self._room.set()


class SessionHost(Protocol):
    """What a session needs from its partition: the append queue and the appends of failed sessions."""

    queue: AppendQueue
    """Appends waiting for ids; the host calls :meth:`StoreSession.appends_queued` after queueing some."""
    inflight: list[PendingAppend]
    """Appends with ids assigned whose batch has not committed (from this or a failed earlier session)."""

    async def session_opened(self, session: StoreSession) -> None:
        """Resolve ``inflight`` against the new session's low-water mark (may read through the session)."""
        ...

    def batch_committed(self, session: StoreSession, appends: Sequence[PendingAppend]) -> None:
        """A batch reached the quorum: ``session.high_water_mark`` is its last id."""
        ...

    def replica_damaged(self, storage: str, detail: str) -> None:
        """A read found ``storage``'s stored copy damaged (it answered CorruptionError): report it."""
        ...

    repairs: RepairStatistics
    """Counts repairs of damage that replicas reported on their own (``StoreSession._watch_damage``)."""


def _loop_ms() -> float:
    """The running event loop's clock in milliseconds: the one time source (virtual in the simulator)."""
    return asyncio.get_running_loop().time() * 1000


class StoreSession:
    """One store session (see the module docstring)."""

    def __init__(
        self,
        *,
        partition_id: int,
        generation: int,
        session_id: int,
        replicas: Sequence[str],
        previous: PartitionMetadata,
        metadata_version: int,
        connector: ReplicaConnector,
        metadata_store: PartitionMetadataStore,
        rng: random.Random,
        config: StoreConfig,
        host: SessionHost,
    ) -> None:
        if not replicas:
            raise ValueError("a store session needs at least one replica")
        self.partition_id = partition_id
        self.generation = generation
        self.session_id = session_id
        self.replicas = tuple(replicas)
        self.connector = connector
        self.metadata_store = metadata_store
        self.rng = rng
        self.config = config
        self.recovery = RecoveryState(previous)
        # Replicas of the previous set that are no longer assigned still vote on the closing high-water mark
        # (and serve as copy sources) until the session opens; without them, removing replicas could leave
        # fewer than a quorum of the previous set reachable and the vote undecidable forever.
        retiring = [s for s in sorted(previous.replicas) if s not in self.replicas]
        self.replica_sessions = {storage: ReplicaSession(self, storage) for storage in self.replicas}
        for storage in retiring:
            self.replica_sessions[storage] = ReplicaSession(self, storage, retiring=True)
        self.quorum = quorum_of(len(self.replicas))
        self.participants: list[ReplicaSession] = []
        self.is_open = False
        self.low_water_mark = -1
        self.high_water_mark = -1
        self.next_id = -1
        self._host = host
        self._metadata_version = metadata_version
        self._metadata_lock = asyncio.Lock()
        self._opened = asyncio.Event()
        self._ended = asyncio.Event()
        self._outcome: SessionOutcome | None = None
        self._end_requested: tuple[EndReason, str] | None = None
        self._writer_idle = False
        self._batches: deque[tuple[Batch, list[PendingAppend]]] = deque()
        """Batches sent and not yet committed, oldest first."""
        self.full_count = min(config.max_batch_size, host.queue.capacity)
        """Queued appends that make a full batch."""
        self.notify_at_count = 1
        """How many queued appends (or :attr:`notify_at_bytes` of data) need :meth:`appends_queued`: one
        while no batch is in flight (an idle writer sends it at once), a full batch otherwise (the only
        thing a writer with batches in flight acts on). A host may skip the call below both, and below a full
        batch while it queues more appends in the same call chain (their last one makes the call: see
        ``StorePartition.submit_tagged``); calling it more often does no harm."""
        self.notify_at_bytes = config.max_batch_bytes
        self._wake = asyncio.Event()
        """Wakes the writer while batches are in flight: one was decided, or a full batch is queued."""
        self._was_opened = False
        self._tasks = TaskList(self._task_failed)
        self.started_ms = _loop_ms()
        self.recovery_ms = -1
        """How long recovery took, from the session's start until it opened (-1 until it opens)."""
        self._repairing: set[str] = set()
        """Replicas a background repair is running for (at most one at a time each)."""

    def __repr__(self) -> str:
        return f"StoreSession(partition={self.partition_id}, session={self.session_id}, open={self.is_open})"

    # -- life cycle ------------------------------------------------------------------------------------------

    async def run(self) -> SessionOutcome:
        """Recover, open, write until the session ends; return how it ended (see the module docstring)."""
        try:
            for storage, replica in self.replica_sessions.items():
                self._tasks.spawn(
                    replica.run(), name=f"replica-{self.partition_id}-{storage}-{self.session_id}"
                )
            self._tasks.spawn(self._open_then_write(), name=f"writer-{self.partition_id}-{self.session_id}")
            await self._ended.wait()
        finally:
            self.is_open = False
            await self._tasks.aclose()
        if self._tasks.errors:
            raise self._tasks.errors[0]
        assert self._outcome is not None  # _ended is only set together with _outcome
        return self._outcome

    def end(self, reason: EndReason, detail: str = "") -> None:
        """End the session now (idempotent: the first reason wins)."""
        if self._outcome is not None:
            return
        log.info(
            "partition %d: store session %d ends: %s%s",
            self.partition_id,
            self.session_id,
            reason.value,
            f" ({detail})" if detail else "",
        )
        self._outcome = SessionOutcome(self.session_id, reason, detail, self._was_opened)
        self.is_open = False
        self._ended.set()

    def request_end(self, reason: EndReason, detail: str = "") -> None:
        """End the session once every batch in flight has been decided; no new batch is sent meanwhile."""
        if not self.is_open or (self._writer_idle and not self._batches):
            self.end(reason, detail)
        elif self._end_requested is None:
            self._end_requested = (reason, detail)

    @property
    def ended(self) -> bool:
        return self._outcome is not None

    def appends_queued(self) -> None:
        """The host queued appends: a writer waiting for a batch to be decided may send another; an idle
        writer's batch is formed and sent right here."""
        if self._batches:
            # Only a writer with batches in flight waits on _wake (an idle one waits for the queue itself);
            # the test is _full_batch_queued's, inlined: this runs once per append.
            queue = self._host.queue
            config = self.config
            n = queue.qsize()
            if (
                n >= config.max_batch_size
                or queue.data_bytes >= config.max_batch_bytes
                or n >= queue.capacity
            ):
                self._wake.set()
        elif (
            self._writer_idle
            and self.is_open
            and self._end_requested is None
            and self.next_id - 1 - self.low_water_mark < self.config.checkpoint_interval
        ):
            # Nothing in flight and the writer waits for appends (the session is open, no end requested or
            # due): this is a lone append (or the first of a burst). It leaves for the replicas now, in the
            # call that queued it, instead of after the writer task's wake-up one loop iteration later; the
            # writer, woken, finds the queue empty (or the burst that came with it) and goes on.
            self._send_batch(self._host.queue.get_nowait())

    def _full_batch_queued(self) -> bool:
        queue = self._host.queue
        config = self.config
        return (
            queue.qsize() >= config.max_batch_size
            or queue.data_bytes >= config.max_batch_bytes
            or queue.full()
        )

    @property
    def batches_in_flight(self) -> tuple[Batch, ...]:
        """Batches sent and not yet committed, oldest first (for introspection and checks)."""
        return tuple(batch for batch, _ in self._batches)

    def end_for(self, replica: ReplicaSession, detail: str) -> None:
        self.end(EndReason.REPLICA_FAILED, f"{replica.storage} {detail}")

    def end_fenced(self, detail: str) -> None:
        self.end(EndReason.FENCED, detail)

    def _task_failed(self, error: BaseException) -> None:
        self.end(EndReason.INTERNAL_ERROR, repr(error))

    async def wait_open(self) -> None:
        await self._opened.wait()

    # -- services for replica sessions -----------------------------------------------------------------------

    async def call(self, request: Awaitable[T]) -> T:
        """Await a storage request, counting one that outlives ``rpc_timeout_ms`` as a broken connection."""
        try:
            async with asyncio.timeout(self.config.rpc_timeout_ms / 1000):
                return await request
        except TimeoutError:
            raise BrokenResourceError(
                f"storage request timed out after {self.config.rpc_timeout_ms} ms"
            ) from None

    def replica_recovered(self, replica: ReplicaSession) -> None:
        self.recovery.mark_recovered(replica.storage)

    def recovery_forget(self, replica: ReplicaSession) -> None:
        """A replica that is not load-bearing failed: it is no longer recovered, nor a copy source."""
        if replica.storage in self.recovery.recovered:
            self.recovery.recovered.remove(replica.storage)

    async def copy_records(
        self, requester: ReplicaSession, start: int, end: int, source: str | None = None
    ) -> list[Record]:
        """Read the next records ``start..`` (at most ``end``, at most one catch-up batch) from another
        replica.

        Before the opening, any replica whose classification is done serves the ids it holds (``source`` picks
        the usher while the vote is undecidable); after it, only participants serve, and only committed ids. A
        source whose stored copy is damaged (CorruptionError) is reported and another one is read: ending the
        session instead would end every next one the same way until the damage is repaired, and the repair
        (``_watch_damage``) needs an open session. Any other failure of a source, or a misbehaving one, ends
        the session (raises :class:`SessionOver`).
        """
        if self.is_open:
            end = min(end, self.high_water_mark)
        count = min(self.config.catch_up_batch_size, end - start + 1)
        if count <= 0:
            return []
        if source is not None:
            candidates = [self.replica_sessions[source]]
        elif self.is_open:
            candidates = [p for p in self.participants if p is not requester and p.readable_max >= start]
        else:
            candidates = [
                r
                for r in self.replica_sessions.values()
                if r is not requester and r.connection is not None and r.readable_max >= start
            ]
        if not candidates:
            self.end(EndReason.REPLICA_FAILED, f"no replica holds {start} for {requester.storage} to copy")
            raise SessionOver
        while True:
            src = candidates[0] if len(candidates) == 1 else self.rng.choice(candidates)
            conn = src.connection
            if conn is None or src.readable_max < start:
                self.end_for(src, "left while being copied from")
                raise SessionOver
            wanted = min(count, src.readable_max - start + 1)
            try:
                records = await self.call(conn.read_records(start, wanted))
            except SessionFencedError as e:
                self.end_fenced(f"{src.storage}: {e}")
                raise SessionOver from None
            except CorruptionError as e:
                self._host.replica_damaged(src.storage, str(e))
                candidates = [c for c in candidates if c is not src]
                if candidates:
                    continue
                self.end_for(src, f"failed a catch-up read: {e!r}")
                raise SessionOver from None
            except WaltzError as e:
                self.end_for(src, f"failed a catch-up read: {e!r}")
                raise SessionOver from None
            count = wanted
            break
        problem = _check_records(records, start, count)
        if problem is not None:
            self.end_for(src, f"returned bad records for {start}..: {problem}")
            raise SessionOver
        return records

    async def mark_clean(self, replica: ReplicaSession) -> None:
        """Record a replica that recovered after the opening as clean in this session (version-checked)."""
        async with self._metadata_lock:
            for _ in range(self.config.max_metadata_attempts):
                current, version = await self.metadata_store.get(self.partition_id)
                if current.session_id != self.session_id:
                    self.end(EndReason.METADATA_CONFLICT, f"metadata now at session {current.session_id}")
                    raise SessionOver
                updated = metadata_with_clean_replica(current, replica.storage, self.session_id)
                try:
                    self._metadata_version = await self.metadata_store.compare_and_set(
                        self.partition_id, updated, version
                    )
                    return
                except ConcurrentUpdateError:
                    continue
            raise ConcurrentUpdateError(f"could not record {replica.storage} clean")

    def try_join(self, replica: ReplicaSession) -> bool:
        """Make a late replica a participant if it is at most ``join_max_lag`` committed ids behind.

        It is sent the batches in flight too (and votes on them), so it only copies committed ids: those below
        the oldest batch in flight. Waiting for a moment with no batch in flight instead could starve it under
        a steady load.
        """
        if not self.is_open or replica.max_id > self.high_water_mark:
            return False
        if self.high_water_mark - replica.max_id > self.config.join_max_lag:
            return False
        replica.role = ReplicaRole.PARTICIPANT
        self.participants.append(replica)
        in_flight = self.batches_in_flight
        for batch in in_flight:
            batch.voting.add_voter()
        replica.join_writes(in_flight)
        log.info(
            "partition %d: replica %s caught up and rejoined session %d %.2f s after the session started, "
            "%d batches in flight",
            self.partition_id,
            replica.storage,
            self.session_id,
            (_loop_ms() - self.started_ms) / 1000,
            len(in_flight),
        )
        return True

    # -- the writer ------------------------------------------------------------------------------------------

    async def _open_then_write(self) -> None:
        recovery = self.recovery
        while not (recovery.resolved is not None and self._recovered_count() >= self.quorum):
            await recovery.wait_for_change()
        resolved = recovery.resolved
        recovered = [s for s in recovery.recovered if s in self.replicas]
        metadata = metadata_after_recovery(
            recovery.previous, self.generation, self.session_id, self.replicas, recovered, resolved
        )
        async with self._metadata_lock:
            try:
                self._metadata_version = await self.metadata_store.compare_and_set(
                    self.partition_id, metadata, self._metadata_version
                )
            except ConcurrentUpdateError as e:
                self.end(EndReason.METADATA_CONFLICT, str(e))
                return
            except WaltzError as e:
                self.end(EndReason.METADATA_UNAVAILABLE, repr(e))
                return
        # Participants are the replicas the metadata just recorded clean that are still connected.
        self.participants = [
            self.replica_sessions[s]
            for s in self.replicas
            if s in recovered and self.replica_sessions[s].role is ReplicaRole.RECOVERED
        ]
        for replica in self.participants:
            replica.role = ReplicaRole.PARTICIPANT
        if len(self.participants) < self.quorum:
            # A recovered replica that was not load-bearing failed while the metadata was written.
            self.end(EndReason.QUORUM_LOST, f"only {len(self.participants)} participants")
            return
        self.low_water_mark = self.high_water_mark = resolved
        self.next_id = resolved + 1
        self.is_open = self._was_opened = True
        self.recovery_ms = int(_loop_ms() - self.started_ms)
        log.info(
            "partition %d: store session %d opened (generation %d) at high-water mark %d after %.2f s of "
            "recovery: %s; participants %s",
            self.partition_id,
            self.session_id,
            self.generation,
            resolved,
            self.recovery_ms / 1000,
            self.recovery_decision(),
            [p.storage for p in self.participants],
        )
        try:
            await self._host.session_opened(self)
        except SessionOver:
            return
        self._opened.set()
        if self.config.damage_poll_interval_ms > 0:
            self._tasks.spawn(
                self._watch_damage(), name=f"damage-watch-{self.partition_id}-{self.session_id}"
            )
        await self._write_loop()

    def recovery_decision(self) -> str:
        """How the session's starting high-water mark was decided, in words (for the log)."""
        recovery = self.recovery
        if not recovery.previous.replicas:
            return "new partition"
        classes = ", ".join(
            f"{r.storage} {r.classification.kind.value}"
            for r in self.replica_sessions.values()
            if r.classification is not None
        )
        votes = ", ".join(f"{s}={hwm}" for s, hwm in sorted(recovery.known.items()))
        return f"previous session {recovery.previous.session_id}, votes {votes or '-'}; replicas {classes}"

    def _recovered_count(self) -> int:
        return sum(1 for s in self.recovery.recovered if s in self.replicas)

    async def _write_loop(self) -> None:
        queue = self._host.queue
        config = self.config
        batches = self._batches
        while True:
            written = self.next_id - 1 - self.low_water_mark
            if self._end_requested is None and written >= config.checkpoint_interval:
                self._end_requested = (EndReason.CHECKPOINT, f"{written} transactions")
            if self._end_requested is not None:
                # Send nothing more: the last batch in flight to be decided ends the session.
                if not batches:
                    self.end(*self._end_requested)
                return
            # Another batch goes out before the ones in flight are decided only if it is full: up to that
            # point appends wait for the next commit and form fewer, larger batches (every batch costs each
            # replica a request and an fsync), and pipelining lifts the ceiling of one full batch per quorum
            # round trip.
            if batches and (len(batches) >= config.max_inflight_batches or not self._full_batch_queued()):
                self._wake.clear()
                await self._wake.wait()
                continue
            if not batches and queue.empty():
                self._writer_idle = True
                try:
                    await queue.wait_arrived()
                finally:
                    self._writer_idle = False
                if batches and not queue.empty() and len(batches) < config.max_inflight_batches:
                    # appends_queued sent the first arrival alone, at once, and more arrived with it (a burst
                    # read in one go): they go now, as the writer would have sent them all together one
                    # iteration after their arrival, rather than wait for that first batch's commit.
                    self._send_batch(queue.get_nowait())
                continue  # Checked again: appends_queued may have sent what arrived itself (a lone append).
            self._send_batch(queue.get_nowait())

    def _send_batch(self, first: PendingAppend) -> None:
        """Give ``first`` and the appends queued after it (up to a full batch) their ids and deliver them to
        every participant as one batch."""
        queue = self._host.queue
        config = self.config
        batches = self._batches
        appends = [first]
        # A batch is bounded in appends and in data bytes (one larger append still goes, alone): every
        # replica request and every in-flight batch holds its data until the batch is decided.
        queue.take_more(appends, len(first.data), config.max_batch_size, config.max_batch_bytes)
        start = txn = self.next_id
        session_id = self.session_id
        records = []
        for append in appends:
            append.transaction_id = txn
            append.session_id = session_id
            # Record(...) without its generated __new__ (see PendingAppend.record).
            records.append(
                _tuple_new(Record, (txn, append.req_id, append.header, append.data, append.checksum))
            )
            txn += 1
        # From here on the appends' fate is decided by this batch, or by the next session's recovery.
        self._host.inflight.extend(appends)
        self.next_id = txn
        voting = Voting(self.quorum, len(self.participants), self._batch_decided)
        batch = Batch(start, tuple(records), voting)
        batches.append((batch, appends))
        self.notify_at_count = self.full_count
        for participant in list(self.participants):
            participant.deliver(batch, len(batches))

    def _batch_decided(self, committed: bool) -> None:
        """A batch's vote is decided: commit every batch at the head of the line that has its quorum.

        Called by the append request whose acknowledgement decided it (or by the writer, when a replica
        abstains). A failed batch ends the session: later batches cannot commit before it, and the appends of
        every batch not committed stay in ``host.inflight`` for the next session to resolve.
        """
        if not committed:
            self.end(EndReason.QUORUM_LOST, f"ids {self.high_water_mark + 1}..{self.next_id - 1} in flight")
            return
        batches = self._batches
        while batches and batches[0][0].voting.outcome:
            batch, appends = batches.popleft()
            self.high_water_mark = batch.last
            if not batches:
                self.notify_at_count = 1
            self._host.batch_committed(self, appends)
        self._wake.set()
        if not batches and self._end_requested is not None:
            self.end(*self._end_requested)

    # -- reads for the partition -----------------------------------------------------------------------------

    def _read_source(self, transaction_id: int) -> ReplicaSession:
        candidates = [p for p in self.participants if p.connection is not None and p.max_id >= transaction_id]
        if not self.is_open or not candidates:
            raise BrokenResourceError(f"no replica of session {self.session_id} serves {transaction_id}")
        return candidates[0] if len(candidates) == 1 else self.rng.choice(candidates)

    async def read_records(self, transaction_id: int, max_count: int) -> list[Record]:
        """Committed records from ``transaction_id``; a failing replica ends the session (and the error
        raises)."""
        count = self._committed_count(transaction_id, max_count)
        if count <= 0:
            return []
        return await self._from_replica(
            transaction_id,
            lambda conn: conn.read_records(transaction_id, count),
            lambda records: _check_records(records, transaction_id, count),
        )

    async def read_run(self, transaction_id: int, max_count: int, max_bytes: int) -> tuple[int, RunBytes]:
        """Committed records from ``transaction_id`` as stored, ``(count, run)`` (see
        :mod:`waltz.protocol.record_run`). The run is relayed, not decoded: its size and first id are checked
        on arrival, its shape and checksums by the reader, so corruption found there is not pinned on the
        replica here (the storage node refuses a record that fails its checksum after the read)."""
        count = self._committed_count(transaction_id, max_count)
        if count <= 0:
            return 0, b""
        return await self._from_replica(
            transaction_id,
            lambda conn: conn.read_run(transaction_id, count, max_bytes),
            lambda answer: None if 0 < answer[0] <= count else f"{answer[0]} records for a read of {count}",
        )

    async def read_headers(self, transaction_id: int, max_count: int) -> list[RecordHeader]:
        """Committed record headers from ``transaction_id`` (see :meth:`read_records`)."""
        count = self._committed_count(transaction_id, max_count)
        if count <= 0:
            return []

        def problem(headers: list[RecordHeader]) -> str | None:
            ids = [h.transaction_id for h in headers]
            if (
                not headers
                or ids != list(range(transaction_id, transaction_id + len(ids)))
                or len(ids) > count
            ):
                return "bad headers"
            return None

        return await self._from_replica(
            transaction_id, lambda conn: conn.read_headers(transaction_id, count), problem
        )

    def _committed_count(self, transaction_id: int, max_count: int) -> int:
        """How many of ``max_count`` ids from ``transaction_id`` are committed (<= 0: none)."""
        return min(max_count, self.high_water_mark - transaction_id + 1) if transaction_id >= 0 else 0

    async def _from_replica(
        self,
        transaction_id: int,
        request: Callable[[ReplicaConnection], Awaitable[T]],
        problem_of: Callable[[T], str | None],
    ) -> T:
        """``request`` on a participant that holds ``transaction_id``.

        A replica whose stored copy is damaged (CorruptionError, found by the node's checksum check right
        after its read) is reported, the read goes to another participant, and the damaged copy is repaired
        in the background from the good one; the damaged replica keeps taking writes. Any other failure, or an
        answer with a problem, ends the session, and the error raises.
        """
        src = self._read_source(transaction_id)
        damaged: list[ReplicaSession] = []
        while True:
            assert src.connection is not None  # checked by _read_source / _other_source
            try:
                answer = await self.call(request(src.connection))
            except CorruptionError as e:
                self._host.replica_damaged(src.storage, str(e))
                damaged.append(src)
                other = self._other_source(transaction_id, damaged)
                if other is None:
                    raise
                src = other
                continue
            except WaltzError as e:
                self.end_for(src, f"failed a read: {e!r}")
                raise
            break
        problem = problem_of(answer)
        if problem is not None:
            self.end_for(src, f"returned bad records: {problem}")
            raise CorruptionError(f"{src.storage} returned bad records for {transaction_id}: {problem}")
        for bad in damaged:
            if bad.storage not in self._repairing:
                self._repairing.add(bad.storage)
                self._tasks.spawn(
                    self._repair(bad, src, transaction_id),
                    name=f"repair-{self.partition_id}-{bad.storage}-{transaction_id}",
                )
        return answer

    def _other_source(self, transaction_id: int, exclude: Sequence[ReplicaSession]) -> ReplicaSession | None:
        candidates = [
            p
            for p in self.participants
            if p.connection is not None and p.max_id >= transaction_id and p not in exclude
        ]
        if not self.is_open or not candidates:
            return None
        return candidates[0] if len(candidates) == 1 else self.rng.choice(candidates)

    async def _repair(self, bad: ReplicaSession, good: ReplicaSession, transaction_id: int) -> None:
        """Copy the committed records of one read's range from ``good`` onto ``bad``, which overwrites only
        the copies that fail its checks. Best effort: a failure is logged; the next damaged read retries."""
        try:
            if good.connection is None or bad.connection is None:
                return
            count = self._committed_count(transaction_id, REPAIR_MAX_RECORDS)
            position, end = transaction_id, transaction_id + count
            while position < end:
                records = await self.call(good.connection.read_records(position, end - position))
                if _check_records(records, position, end - position) is not None:
                    return
                await self.call(bad.connection.repair(records))
                position += len(records)
            log.info(
                "partition %d: repaired %s's copy of %d..%d from %s",
                self.partition_id,
                bad.storage,
                transaction_id,
                end - 1,
                good.storage,
            )
        except WaltzError as e:
            log.warning("partition %d: repair of %s failed: %r", self.partition_id, bad.storage, e)
        finally:
            self._repairing.discard(bad.storage)

    # -- damage found by the storage nodes' scrub ------------------------------------------------------------

    async def _watch_damage(self) -> None:
        """Every ``damage_poll_interval_ms``, ask each participant which stored records it found damaged on
        its own, and repair the committed ones from the other participants.

        A storage node's background scrub finds damage that no read has met yet; only the owner knows which
        replicas are clean and which ids are committed, so the owner asks. Polling on the session's existing
        connection keeps the storage node passive (it never calls servers) and touches no message of the
        write path; one small request per replica per interval is the whole cost. Best effort: a failed poll
        is left to the replica's own requests, which notice a broken node; a failed repair is tried again
        :data:`REPAIR_RETRY_POLLS` polls later.
        """
        interval_s = self.config.damage_poll_interval_ms / 1000
        skip: dict[str, int] = {}
        failing = self._host.repairs.failing
        while True:
            await asyncio.sleep(interval_s)
            for gone in [s for s in failing if s not in self.replica_sessions]:
                del failing[gone]  # no longer a replica: its damage is not this partition's to repair
            for replica in list(self.participants):
                storage, conn = replica.storage, replica.connection
                if conn is None or storage in self._repairing:
                    continue
                if skip.get(storage, 0) > 0:
                    skip[storage] -= 1
                    continue
                try:
                    ids = await self.call(conn.damaged_records(MAX_DAMAGED_IDS))
                except WaltzError as e:
                    log.debug("partition %d: damage poll of %s failed: %r", self.partition_id, storage, e)
                    continue
                # Ids above the committed mark are not settled: recovery decides them, not a repair.
                last = min(self.high_water_mark, replica.max_id)
                committed = sorted(t for t in set(ids) if 0 <= t <= last)
                if not committed:
                    # Repaired meanwhile (by a read that met the damage) or truncated: nothing is failing.
                    failing.pop(storage, None)
                    continue
                self._repairing.add(storage)
                try:
                    if not await self._repair_reported(replica, committed):
                        skip[storage] = REPAIR_RETRY_POLLS
                finally:
                    self._repairing.discard(storage)

    async def _repair_reported(self, bad: ReplicaSession, ids: Sequence[int]) -> bool:
        """Rewrite ``bad``'s damaged copies of the committed ``ids`` (sorted) with verified copies read from
        other participants; True if every one was rewritten."""
        stats = self._host.repairs
        stats.started += 1
        what = _describe_ids(ids)
        stats.in_progress[bad.storage] = what
        try:
            return await self._rewrite_reported(bad, ids, what, stats)
        finally:
            stats.in_progress.pop(bad.storage, None)

    async def _rewrite_reported(
        self, bad: ReplicaSession, ids: Sequence[int], what: str, stats: RepairStatistics
    ) -> bool:
        """The body of :meth:`_repair_reported`: rewrite, count and log."""
        log.info(
            "partition %d: repairing %d damaged record(s) %s reported by %s, from the other replicas",
            self.partition_id,
            len(ids),
            what,
            bad.storage,
        )
        rewritten = 0
        try:
            for start, count in _runs(ids):
                position, end = start, start + count
                while position < end:
                    records = await self._good_copies(bad, position, end - position)
                    conn = bad.connection
                    if conn is None:
                        raise BrokenResourceError(f"{bad.storage} left the session")
                    await self.call(conn.repair(records))
                    position += len(records)
                    rewritten += len(records)
        except WaltzError as e:
            stats.failed += 1
            stats.records += rewritten
            stats.failing[bad.storage] = f"{what}: {e!r}"
            log.warning(
                "partition %d: repair of %s's damaged records %s failed after %d record(s); tried again "
                "later: %r",
                self.partition_id,
                bad.storage,
                what,
                rewritten,
                e,
            )
            return False
        stats.finished += 1
        stats.records += rewritten
        stats.failing.pop(bad.storage, None)
        log.info(
            "partition %d: repaired %d damaged record(s) %s on %s",
            self.partition_id,
            rewritten,
            what,
            bad.storage,
        )
        return True

    async def _good_copies(self, bad: ReplicaSession, start: int, count: int) -> list[Record]:
        """Verified records ``start..`` (at most ``count``) from a participant other than ``bad``."""
        error: WaltzError | None = None
        for src in self.participants:
            conn = src.connection
            if src is bad or conn is None or src.max_id < start:
                continue
            try:
                records = await self.call(conn.read_records(start, count))
            except CorruptionError as e:
                self._host.replica_damaged(src.storage, str(e))
                error = e
                continue
            problem = _check_records(records, start, count)
            if problem is None:
                return records
            error = CorruptionError(f"{src.storage} returned bad records for {start}: {problem}")
        raise error or BrokenResourceError(f"no other participant holds transaction {start}")


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as ``(first, count)`` runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for txn in ids:
        if runs and runs[-1][0] + runs[-1][1] == txn:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((txn, 1))
    return runs


def _describe_ids(ids: Sequence[int], max_runs: int = 5) -> str:
    """``17, 30..32`` for a log line (the first ``max_runs`` runs, then how many more)."""
    runs = _runs(ids)
    text = ", ".join(f"{a}" if n == 1 else f"{a}..{a + n - 1}" for a, n in runs[:max_runs])
    return text + (f" and {len(runs) - max_runs} more runs" if len(runs) > max_runs else "")


def _check_records(records: Sequence[Record], start: int, max_count: int) -> str | None:
    """Why a read answer is unusable (None if it is fine): empty, too long, not dense from ``start``,
    corrupt."""
    if not records:
        return "no records"
    if len(records) > max_count:
        return f"{len(records)} records, asked for {max_count}"
    for i, rec in enumerate(records):
        if rec.transaction_id != start + i:
            return f"id {rec.transaction_id} at position {i}"
        if not rec.verify():
            return f"record {rec.transaction_id} fails its checksum"
    return None
