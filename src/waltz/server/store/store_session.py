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
from typing import Any, Protocol, TypeVar

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.errors import (
    BrokenResourceError,
    ConcurrentUpdateError,
    CorruptionError,
    SessionFencedError,
    TrimmedError,
    WaltzError,
)
from waltz.protocol.record_run import RunBytes
from waltz.protocol.records import Record, RecordHeader
from waltz.runtime import TaskSet
from waltz.server.store.appends import AppendQueue, PendingAppend
from waltz.server.store.interfaces import PartitionMetadataStore, ReplicaConnection, ReplicaConnector
from waltz.server.store.recovery import RecoveryState, metadata_after_recovery, metadata_with_clean_replica
from waltz.server.store.replica_session import Batch, ReplicaContext, ReplicaRole, ReplicaSession, SessionOver
from waltz.server.store.scrub_repair import DamageWatch, check_records
from waltz.server.store.support import InvariantViolation, RepairStatistics, StoreConfig
from waltz.server.store.trimming import restart_at_trim_point
from waltz.server.store.voting import Voting, quorum_of

__all__ = [
    "EndReason",
    "SessionHost",
    "SessionOutcome",
    "StoreSession",
]

log = logging.getLogger(__name__)

_tuple_new = tuple.__new__

T = TypeVar("T")

REPAIR_MAX_RECORDS = 10_000
"""Records one background repair copies at most (one read's range; the node caps what one read returns)."""


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


class SessionHost(Protocol):
    """What a session needs from its partition: the append queue and the appends of failed sessions."""

    queue: AppendQueue
    """Appends waiting for ids; the host calls :meth:`StoreSession.appends_queued` after queueing some."""

    async def session_opened(self, session: StoreSession) -> None:
        """Resolve the survivors of failed earlier sessions (:meth:`StoreSession.take_survivors`) against the
        new session's low-water mark (may read through the session)."""
        ...

    def batch_committed(self, session: StoreSession, appends: Sequence[PendingAppend]) -> None:
        """A batch reached the quorum: ``session.high_water_mark`` is its last id."""
        ...

    def replica_damaged(self, storage: str, detail: str) -> None:
        """A read found ``storage``'s stored copy damaged (it answered CorruptionError): report it."""
        ...

    def replica_joined(self, session: StoreSession, storage: str) -> None:
        """``storage`` caught up and became a participant of the open ``session`` (it is told the trim point,
        which it missed at the opening)."""
        ...

    repairs: RepairStatistics
    """Counts repairs of damage that replicas reported on their own (``scrub_repair.DamageWatch``)."""
    trim_point: int
    """The partition's trim point: nothing below it is repaired."""


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
        context = ReplicaContext(partition_id, session_id, config, rng, connector, self.recovery)
        self.replica_sessions = {storage: ReplicaSession(self, context, storage) for storage in self.replicas}
        for storage in retiring:
            self.replica_sessions[storage] = ReplicaSession(self, context, storage, retiring=True)
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
        self._init_writer(config, host)
        self._was_opened = False
        self._stopped = False  # run() returned: no task of the session runs
        self._tasks = TaskSet(self._task_failed)
        self._error: BaseException | None = None  # A task's bug that ended the session: run() raises it.
        self.started_ms = _loop_ms()
        self.recovery_ms = -1
        """How long recovery took, from the session's start until it opened (-1 until it opens)."""
        self.repairing: set[str] = set()
        """Replicas a background repair is running for (at most one at a time each)."""

    def _init_writer(self, config: StoreConfig, host: SessionHost) -> None:
        """The writer's state: batches in flight, when it must be told of queued appends, how it waits."""
        self._writer_idle = False
        self._parked_idle = False
        """The writer waits on ``_wake`` where the last decision left it idle (see :meth:`_batch_decided`)."""
        self._burst_end: asyncio.Handle | None = None
        """The callback of the next loop pass that sends the burst an idle writer was promised (see
        :meth:`appends_queued`), unless :meth:`end_burst` comes first."""
        self._loop = asyncio.get_running_loop()
        self._on_decided = self._batch_decided
        self._on_burst_end = self._burst_ended
        """(Bound once: each is handed over once per batch at 256 partitions.)"""
        self._batches: deque[tuple[Batch, list[PendingAppend]]] = deque()
        """Batches sent and not yet committed, oldest first."""
        self.full_count = min(config.max_batch_size, host.queue.capacity)
        """Queued appends that make a full batch."""
        self.notify_at_count = 1
        """How many queued appends (or :attr:`notify_at_bytes` of data) need :meth:`appends_queued`: one
        while no batch is in flight (an idle writer sends it at once), a full batch otherwise (the only
        thing a writer with batches in flight acts on). A host may skip the call below both, and below a full
        batch while it queues more appends in the same call chain, except for the first of them (their last
        one sends them; see ``StorePartition.submit``); calling it more often does no harm."""
        self.notify_at_bytes = config.max_batch_bytes
        self._wake = asyncio.Event()
        """Wakes the writer waiting on decisions (or left idle by one: see :meth:`_batch_decided`)."""

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
            self._stopped = True
        if self._error is not None:
            raise self._error
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

    def appends_queued(self, more: bool = False) -> None:
        """The host queued appends: a writer waiting for a batch to be decided may send another; an idle
        writer's batch is formed and sent right here. ``more``: the host queues more right after these (see
        ``StorePartition.submit``); it calls this for the first of them too."""
        if self._batches:
            # Only a writer with batches in flight waits on _wake (an idle one waits for the queue itself);
            # the test is _full_batch_queued's, inlined: this runs once per append.
            queue = self._host.queue
            config = self.config
            n = len(queue.items)
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
            # due): this is a lone append (or a burst). It leaves for the replicas now, in the call that
            # queued it, instead of after the writer task's wake-up one loop iteration later.
            if more and len(self._host.queue.items) < self.full_count:
                # The first of a burst: its last append sends them all. The rest of the read may be other
                # partitions' appends, though: then a callback sends it in the next loop pass (not a wake-up
                # of the writer task, which costs several times more, for each of many partitions).
                if self._burst_end is None:
                    self._burst_end = self._loop.call_soon(self._on_burst_end)
                return
            if self._parked_idle:
                # The writer waits on _wake, where it would wait with this batch in flight: it is not woken
                # (with many partitions, or one append at a time, a task wake-up per batch fewer).
                self._parked_idle = self._writer_idle = False
            # (A writer waiting for the queue wakes, finds it empty or the burst that came with it, goes on.)
            self._send_batch(self._host.queue.get_nowait())
        elif self._parked_idle:
            self._parked_idle = False
            self._wake.set()  # an end or a checkpoint due: the writer acts on it

    def end_burst(self) -> None:
        """The host says the burst it promised ended (the rest of its read was for other partitions): what
        is left of it goes now rather than in the next loop pass."""
        handle = self._burst_end
        if handle is not None:
            handle.cancel()
            self._burst_ended()

    def _burst_ended(self) -> None:
        """The loop pass that queued a burst is over: what is left of it goes (if nothing took it yet)."""
        self._burst_end = None
        if self._host.queue.items:
            self.appends_queued()

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

    @property
    def appends_in_flight(self) -> int:
        """Appends of the batches sent and not yet committed (for introspection)."""
        return sum(len(appends) for _, appends in self._batches)

    def take_survivors(self) -> list[PendingAppend]:
        """Hand back the appends of every batch not committed, oldest first, once the session has ended.

        The session is their only record until then; afterwards the next session's opening decides them
        (an id at or below its low-water mark succeeded if the stored record is theirs)."""
        if self._batches and not self._stopped:
            raise InvariantViolation(f"{self!r}: survivors taken while the session runs")
        survivors = [append for _, appends in self._batches for append in appends]
        self._batches.clear()
        return survivors

    def replica_failed(self, replica: ReplicaSession, detail: str) -> None:
        """ReplicaHost: ``replica`` failed while load-bearing (or misbehaved): the session ends."""
        self.end(EndReason.REPLICA_FAILED, f"{replica.storage} {detail}")

    def fenced(self, detail: str) -> None:
        """ReplicaHost: a newer session fenced this one on a replica: the session ends."""
        self.end(EndReason.FENCED, detail)

    def _task_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        # A bug: the session ends, and run() raises it to its owner (the store partition logs it once).
        if self._error is None:
            self._error = error
        self.end(EndReason.INTERNAL_ERROR, f"task {task.get_name()}: {error!r}")

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

    async def copy_records(
        self, requester: ReplicaSession, start: int, end: int, source: str | None = None
    ) -> list[Record]:
        """Read the next records ``start..`` (at most ``end``, at most one catch-up batch) from another
        replica.

        Before the opening, any replica whose classification is done serves the ids it holds (``source`` picks
        the usher while the vote is undecidable); after it, only participants serve, and only committed ids. A
        source whose stored copy is damaged (CorruptionError) is reported and another one is read: ending the
        session instead would end every next one the same way until the damage is repaired, and the repair
        (``DamageWatch``) needs an open session. Any other failure of a source, or a misbehaving one, ends
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
                self.replica_failed(src, "left while being copied from")
                raise SessionOver
            wanted = min(count, src.readable_max - start + 1)
            try:
                records = await self.call(conn.read_records(start, wanted))
            except SessionFencedError as e:
                self.fenced(f"{src.storage}: {e}")
                raise SessionOver from None
            except TrimmedError as e:
                # What the requester lacks was trimmed: it starts again at the trim point (see trimming.py).
                await restart_at_trim_point(self, requester, e.trim_point)
                if requester.max_id >= end:
                    return []
                return await self.copy_records(requester, requester.max_id + 1, end, source)
            except CorruptionError as e:
                self._host.replica_damaged(src.storage, str(e))
                candidates = [c for c in candidates if c is not src]
                if candidates:
                    continue
                self.replica_failed(src, f"failed a catch-up read: {e!r}")
                raise SessionOver from None
            except WaltzError as e:
                self.replica_failed(src, f"failed a catch-up read: {e!r}")
                raise SessionOver from None
            count = wanted
            break
        problem = check_records(records, start, count)
        if problem is not None:
            self.replica_failed(src, f"returned bad records for {start}..: {problem}")
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
        self.participants.append(replica)
        in_flight = self.batches_in_flight
        for batch in in_flight:
            batch.voting.add_voter()
        replica.join_writes(in_flight)
        self._host.replica_joined(self, replica.storage)
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
            replica.become_participant()
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
                DamageWatch(self, self._host).run(),
                name=f"damage-watch-{self.partition_id}-{self.session_id}",
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
                # _batch_decided may have made it idle while it waited.
                self._writer_idle = self._parked_idle = False
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
        if queue.items:  # (most batches at many partitions are one append: no call then)
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
        self.next_id = txn
        voting = Voting(self.quorum, len(self.participants), self._on_decided)
        batch = Batch(start, tuple(records), voting)
        batches.append((batch, appends))
        self.notify_at_count = self.full_count
        for participant in list(self.participants):
            participant.deliver(batch, len(batches))

    def _batch_decided(self, committed: bool) -> None:
        """A batch's vote is decided: commit every batch at the head of the line that has its quorum.

        Called by the append request whose acknowledgement decided it (or by the writer, when a replica
        abstains). A failed batch ends the session: later batches cannot commit before it, and the appends of
        every batch not committed are handed back by :meth:`take_survivors` for the next session to resolve.
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
        if (
            batches
            or self._end_requested is not None
            or self._host.queue.items
            or self.next_id - 1 - self.low_water_mark >= self.config.checkpoint_interval
        ):
            self._wake.set()
        else:
            # Nothing in flight, nothing queued, no checkpoint due: the writer would wake only to wait for an
            # append. It stays parked on _wake and counts as idle: appends_queued sends the next append itself
            # and leaves it parked, or wakes it when there is more to do. With many partitions (every batch
            # about one append) or one append at a time, the writer task then never runs.
            self._writer_idle = self._parked_idle = True
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
            lambda records: check_records(records, transaction_id, count),
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
                self.replica_failed(src, f"failed a read: {e!r}")
                raise
            break
        problem = problem_of(answer)
        if problem is not None:
            self.replica_failed(src, f"returned bad records: {problem}")
            raise CorruptionError(f"{src.storage} returned bad records for {transaction_id}: {problem}")
        for bad in damaged:
            if bad.storage not in self.repairing:
                self.repairing.add(bad.storage)
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
                if check_records(records, position, end - position) is not None:
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
            self.repairing.discard(bad.storage)
