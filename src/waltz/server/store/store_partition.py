"""The store partition: what the server's partition uses to append and read, across store sessions.

A :class:`StorePartition` runs one supervisor task that keeps a store session going:

* **Session ids.** Each session takes its id by a version-checked write of the partition metadata
  ``(generation, session id + 1, same replica states)``. If ZooKeeper already records a higher generation, the
  partition moved to another server: the write is refused with :class:`GenerationMismatchError` and this
  partition stops writing (appends fail with that error) until :meth:`set_generation` raises its generation.
* **New sessions.** Any failure ends a session; the supervisor starts the next one, backing off exponentially
  (``initial_retry_interval_ms`` doubling to ``max_retry_interval_ms``, jittered, on the loop's clock)
  unless the last session had opened or ended on purpose (checkpoint interval, replica-set change).
* **Appends.** :meth:`submit` queues the request (at most ``max_queued_appends``: beyond, it queues nothing
  and the caller waits for :meth:`wait_room`) and tells the listener it was submitted with how it ended;
  :meth:`append` does both and returns the transaction id once committed. An append is in one place at a
  time: the queue, a batch of the session that gave it an id, or the survivors that session handed back.
  Queued appends survive a failed session untouched. The survivors are resolved when the next session
  opens: an id at or below its low-water mark (the resolved high-water mark) whose stored record carries the
  append's request id succeeded; every other one failed with :class:`QuorumLostError` (it is not in the log
  and never will be).
* **Reads** go to a participant of the open session, only up to the committed high-water mark, with checksums
  verified after the read.

Guarantees: transaction ids are dense and assigned in queue order; an id returned by :meth:`append` is
committed (on a quorum of the replica set, fsynced) and is never lost or changed; :attr:`high_water_mark`
never decreases.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.errors import (
    ClosedResourceError,
    ConcurrentUpdateError,
    CorruptionError,
    GenerationMismatchError,
    PartitionNotReadyError,
    QuorumLostError,
    TrimmedError,
    WaltzError,
)
from waltz.protocol.record_run import RunBytes
from waltz.protocol.records import Record, RecordHeader, crc32
from waltz.runtime import TaskSet
from waltz.server.store.appends import FUTURES, AppendListener, AppendQueue, PendingAppend
from waltz.server.store.interfaces import (
    AppendLike,
    PartitionMetadataStore,
    ReplicaConnector,
)
from waltz.server.store.replica_session import SessionOver
from waltz.server.store.store_session import EndReason, SessionOutcome, StoreSession
from waltz.server.store.support import (
    Backoff,
    InvariantViolation,
    RepairStatistics,
    RetryLog,
    StoreConfig,
)
from waltz.server.store.trimming import tell_replicas

__all__ = ["BATCH_APPENDS_BOUNDS", "StorePartition", "StoreStatistics"]

log = logging.getLogger(__name__)

R = TypeVar("R")

_object_new = object.__new__

_NO_BACKOFF = (EndReason.CHECKPOINT, EndReason.REPLICAS_CHANGED)

BATCH_APPENDS_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Upper bounds of :attr:`StoreStatistics.batch_appends_counts`' buckets: powers of two, so an append count's
bucket is ``(count - 1).bit_length()`` (no search per batch)."""
_LAST_BATCH_BUCKET = len(BATCH_APPENDS_BOUNDS)


@dataclass
class StoreStatistics:
    """What a store partition counts for monitoring (since it was created)."""

    sessions_opened: int = 0
    sessions_ended: dict[str, int] = field(default_factory=dict)
    """Ended sessions by :class:`EndReason` value."""
    recovery_seconds_sum: float = 0.0
    """Total recovery time of the sessions opened (start of a session to its opening)."""
    last_recovery_seconds: float = 0.0
    batch_appends_counts: list[int] = field(default_factory=lambda: [0] * (len(BATCH_APPENDS_BOUNDS) + 1))
    """Committed batches by how many appends they held, one count per :data:`BATCH_APPENDS_BOUNDS` bucket (a
    batch of n appends counts in the first bucket whose bound is >= n), the last one above every bound. Each
    batch cost every replica a write request and an fsync: many small batches under load mean storage work
    that larger ones would have shared."""
    batch_appends_sum: int = 0
    """Appends of the committed batches counted in :attr:`batch_appends_counts`."""


class StorePartition:
    """One partition of the replicated log, as the server sees it (see the module docstring).

    Use ``async with StorePartition(...) as partition`` or :meth:`start` / :meth:`close`.
    """

    def __init__(
        self,
        partition_id: int,
        generation: int,
        replicas: Sequence[str],
        *,
        connector: ReplicaConnector,
        metadata_store: PartitionMetadataStore,
        rng: random.Random | None = None,
        config: StoreConfig | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("a partition needs at least one replica")
        self.partition_id = partition_id
        self._generation = generation
        self._replicas = tuple(replicas)
        self._connector = connector
        self._metadata_store = metadata_store
        self._rng = rng if rng is not None else random.Random()
        self.config = config if config is not None else StoreConfig()
        self.queue = AppendQueue(self.config.max_queued_appends)
        self._survivors: list[PendingAppend] = []
        """Appends a failed session left in flight (:meth:`StoreSession.take_survivors`), oldest first: the
        next session to open decides them. Every other append is in the queue or in the session's batches."""
        self._submitted = 0
        self._resolved = 0
        """Appends queued and appends resolved so far (resolved in queue order: see :meth:`flush`)."""
        self._resolutions = asyncio.Event()
        """Set whenever appends are resolved while a waiter (flush, wait_resolution) waits on it."""
        self._resolution_awaited = False
        """A waiter cleared :attr:`_resolutions` and waits: every commit sets it only then (Event.set is a
        Python call, and commits come once per batch)."""
        self._hwm = -1
        self.trim_point = 0
        """Reads below it fail with TrimmedError; raised by :meth:`set_trim_point` only."""
        self._trim_wanted = asyncio.Event()
        """Set when the open session's replicas should be told the trim point (see ``_trim_loop``)."""
        self._session: StoreSession | None = None
        self._session_changed = asyncio.Event()
        self._generation_raised = asyncio.Event()
        self._stale = False
        self._closed = False
        self._tasks = TaskSet(self._supervisor_failed)
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop :meth:`start` ran on (asking asyncio for it costs a getpid system call each time)."""
        self.outcomes: list[SessionOutcome] = []
        """How each session ended, oldest first (bounded to the last 100)."""
        self.metadata_conflict: str | None = None
        """Set while the partition metadata holds a generation no assignment explains (see
        :meth:`_wait_for_newer_generation`)."""
        self._stale_detail = ""
        self.damaged_replicas: dict[str, int] = {}
        """Reads that found a replica's stored copy damaged, by storage node (reported in /health)."""
        self.internal_errors: list[BaseException] = []
        """Bugs caught by the supervisor (it logs them and starts a new session)."""
        self.failure: BaseException | None = None
        """What ended the supervisor (a bug): the partition takes no appends, and its owner hears of it
        through :attr:`on_failure`."""
        self.on_failure: Callable[[BaseException], None] | None = None
        """Called once if the supervisor fails (the server's partition reports it and is reopened)."""
        self.stats = StoreStatistics()
        """Running totals for metrics (plain numbers: the server reads them when scraped)."""
        self.repairs = RepairStatistics()
        """SessionHost: repairs of damage that replicas reported on their own (their scrub found it)."""

    # -- life cycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the supervisor (idempotent)."""
        if self._closed:
            raise ClosedResourceError("store partition is closed")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._tasks.spawn(self._supervise(), name=f"store-partition-{self.partition_id}")
            self._tasks.spawn(self._trim_loop(), name=f"store-trim-{self.partition_id}")

    async def __aenter__(self) -> StorePartition:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the supervisor and the session; appends not yet resolved fail with ClosedResourceError."""
        if self._closed:
            return
        self._closed = True
        self._session_changed.set()
        await self._tasks.aclose()
        self._fail_everything(ClosedResourceError(f"partition {self.partition_id} store was closed"))

    def _supervisor_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        # A bug ended the supervisor or the trim loop: the partition takes no appends. Its owner hears of it
        # (the server's partition logs it once and is reopened); without one, it is logged here.
        if self.failure is not None:
            return
        self.failure = error
        self._fail_everything(
            PartitionNotReadyError(f"partition {self.partition_id} store failed: {error!r}")
        )
        if self.on_failure is not None:
            self.on_failure(error)
        else:
            log.error("partition %d: task %s failed", self.partition_id, task.get_name(), exc_info=error)

    # -- state -----------------------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def replicas(self) -> tuple[str, ...]:
        return self._replicas

    @property
    def high_water_mark(self) -> int:
        """The highest committed transaction id known to this server (-1 before the first session opens)."""
        return self._hwm

    @property
    def is_healthy(self) -> bool:
        """True while a store session is open (recovered, writing)."""
        return self._session is not None and self._session.is_open

    @property
    def session(self) -> StoreSession | None:
        """The current session (for introspection and tests)."""
        return self._session

    def replica_positions(self) -> dict[str, tuple[str, int]]:
        """Each replica of the current session: (role, max transaction id it acknowledged); empty between
        sessions. Its lag is ``high_water_mark - max id`` (for metrics and ``waltz top``)."""
        session = self._session
        if session is None:
            return {}
        # A copy first (one C-level call): /metrics calls this from its scrape thread (see waltz.http).
        return {
            storage: (replica.role.value, replica.max_id)
            for storage, replica in list(session.replica_sessions.items())
            if not replica.retiring
        }

    def set_generation(self, generation: int) -> None:
        """Raise the partition's generation (never lowered); a stale partition may then try again."""
        if generation > self._generation:
            self._generation = generation
            self._stale = False
            self._generation_raised.set()

    def set_replicas(self, replicas: Sequence[str]) -> None:
        """Use a new replica set: the current session ends after its batches in flight; the next one uses the
        set.

        New replicas are brought up to date by the next session while writes continue once a quorum of the new
        set has recovered.
        """
        new = tuple(replicas)
        if not new:
            raise ValueError("a partition needs at least one replica")
        if new == self._replicas:
            return
        self._replicas = new
        if self._session is not None:
            self._session.request_end(EndReason.REPLICAS_CHANGED, str(list(new)))

    def request_new_session(self) -> None:
        """End the current session after its batches in flight and start a new one (with recovery), as the
        checkpoint interval does: replicas that sat the session out rejoin, clean points advance."""
        if self._session is not None:
            self._session.request_end(EndReason.CHECKPOINT, "requested")

    # -- appends ---------------------------------------------------------------------------------------------

    async def append(self, request: AppendLike) -> int:
        """Append one transaction; return its id once committed (waits while the queue is full).

        Raises GenerationMismatchError if the request's generation is not the partition's (or the partition
        moved away), QuorumLostError if it definitely did not commit, CorruptionError if its data does not
        match its checksum, ClosedResourceError if the partition is closed.
        """
        if crc32(request.data) != request.checksum:
            raise CorruptionError(f"append {request.req_id!r}: data does not match its checksum")
        loop = self._loop
        if loop is None:
            raise PartitionNotReadyError(f"partition {self.partition_id} store is not started")
        future: asyncio.Future[int] = loop.create_future()
        while not self.submit(request, FUTURES, future):
            await self.queue.wait_room()
        return await future

    async def wait_room(self) -> None:
        """Return once the append queue has room (or the partition failed every queued append)."""
        await self.queue.wait_room()

    def submit(
        self,
        request: AppendLike,
        listener: AppendListener,
        tag: object = None,
        received_s: float = 0.0,
        more: bool = False,
    ) -> bool:
        """Queue one transaction without waiting; False (nothing queued) if the queue is full (then wait for
        :meth:`wait_room` and submit it again). ``listener`` hears how it ends, exactly once, together with
        the other appends of its batch (:class:`AppendListener`); ``tag`` and ``received_s`` go with it (the
        server's partition: the append's lock request, its arrival).

        Transactions get ids in the order they were queued. The caller verified ``request.data`` against its
        checksum (the client codec does as it decodes; :meth:`append` does); the storage nodes verify it again
        right before writing. Raises GenerationMismatchError, ClosedResourceError or PartitionNotReadyError
        if the append is refused up front.

        ``more=True`` is the caller's word that it submits more appends right after this one, in the same
        call chain (the rest of one socket read): an idle writer does not send this one alone, but waits for
        the append submitted without it (or for a full batch) and sends them all as one batch. Every batch
        costs each replica a request and an fsync, so a burst leaves as one. Nothing depends on the word for
        correctness: appends left queued by a caller that broke it go with the writer's next turn, one loop
        iteration later."""
        if self._closed:
            raise ClosedResourceError(f"partition {self.partition_id} store is closed")
        if self._loop is None or self.failure is not None:
            raise PartitionNotReadyError(f"partition {self.partition_id} store is not running")
        req_id = request.req_id
        # The ReqId's generation, decoded inline (its property is a Python call): the low 32 bits of msb.
        generation = req_id[0] & 0xFFFFFFFF
        if generation != self._generation & 0xFFFFFFFF or self._stale:
            raise GenerationMismatchError(
                f"request generation {req_id.generation}, partition generation {self._generation}"
            )
        # PendingAppend(...) without its generated __init__ (a Python call with a dozen arguments): every
        # slot is set here, once per append.
        pending = _object_new(PendingAppend)
        pending.req_id = req_id
        pending.header = request.header
        pending.data = request.data
        pending.checksum = request.checksum
        pending.listener = listener
        pending.tag = tag
        pending.received_s = received_s
        pending.transaction_id = -1
        pending.session_id = -1
        pending.resolved = False
        queue = self.queue
        queued = queue.offer(pending)
        if not queued:
            return False  # full
        self._submitted += 1
        session = self._session
        # The session's test, inlined: the call is needed only for an idle writer or a full batch (only the
        # latter, and the first append, while more appends follow).
        if session is not None and (
            queued >= (session.full_count if more else session.notify_at_count)
            or queue.data_bytes >= session.notify_at_bytes
            or (more and queued == 1)
        ):
            session.appends_queued(more)
        return True

    def end_burst(self) -> None:
        """The appends submitted with ``more=True`` are the last of their burst after all: they go now (else
        a callback of the next loop pass sends them)."""
        session = self._session
        if session is not None:
            session.end_burst()

    async def wait_open(self) -> int:
        """Wait until a store session is open (recovered) and return the committed high-water mark."""
        while not self.is_healthy:
            if self._closed:
                raise ClosedResourceError(f"partition {self.partition_id} store is closed")
            self._session_changed.clear()
            # Set by session_opened (the session already reports itself open then) and by close().
            await self._session_changed.wait()
        return self._hwm

    async def flush(self) -> int:
        """Wait until every append submitted before this call is resolved; return the high-water mark.

        Appends are resolved in the order they were queued (ids are given in queue order, batches commit in
        id order, a failed session's survivors are decided before the next one commits anything), so a count
        is enough."""
        last = self._submitted
        while self._resolved < last:
            self._resolutions.clear()
            self._resolution_awaited = True
            await self._resolutions.wait()
        return self._hwm

    async def wait_resolution(self) -> bool:
        """Wait until the store next resolves appends (a batch commits, or a session's appends fail); False
        at once, without waiting, if no append is unresolved. Each resolution's listeners have run by the
        time this returns (they are called synchronously, before the waiters wake)."""
        if self._resolved == self._submitted:
            return False
        self._resolutions.clear()
        self._resolution_awaited = True
        await self._resolutions.wait()
        return True

    # -- reads -----------------------------------------------------------------------------------------------

    async def read_record(self, transaction_id: int) -> Record | None:
        """The committed record ``transaction_id`` (None above the high-water mark), checksum verified."""
        records = await self.read_records(transaction_id, 1)
        return records[0] if records else None

    async def read_records(self, transaction_id: int, max_count: int) -> list[Record]:
        """Up to ``max_count`` committed records from ``transaction_id``."""
        self.check_trim(transaction_id)
        if transaction_id < 0 or transaction_id > self._hwm or max_count <= 0:
            return []
        return await self._read(lambda s: s.read_records(transaction_id, max_count))

    async def read_headers(self, transaction_id: int, max_count: int) -> list[RecordHeader]:
        """Up to ``max_count`` committed record headers from ``transaction_id``."""
        self.check_trim(transaction_id)
        if transaction_id < 0 or transaction_id > self._hwm or max_count <= 0:
            return []
        return await self._read(lambda s: s.read_headers(transaction_id, max_count))

    async def read_run(self, transaction_id: int, max_count: int, max_bytes: int) -> tuple[int, RunBytes]:
        """Up to ``max_count`` committed records from ``transaction_id`` as stored (a record run, see
        :meth:`StoreSession.read_run`): ``(count, run)``, ``(0, b"")`` at or past the high-water mark."""
        self.check_trim(transaction_id)
        if transaction_id < 0 or transaction_id > self._hwm or max_count <= 0:
            return 0, b""
        return await self._read(lambda s: s.read_run(transaction_id, max_count, max_bytes))

    async def segment_sizes(self, max_segments: int) -> list[tuple[int, int]]:
        """``(first id, bytes)`` of the newest segments of a replica of the open session (the first that
        answers), oldest first: what a retention policy in bytes measures."""

        async def ask(session: StoreSession) -> list[tuple[int, int]]:
            error: WaltzError = PartitionNotReadyError(f"partition {self.partition_id}: no replica to ask")
            for replica in list(session.participants):
                conn = replica.connection
                if conn is None:
                    continue
                try:
                    return await session.call(conn.segment_sizes(max_segments))
                except WaltzError as e:
                    error = e
            raise error

        return await self._read(ask)

    def check_trim(self, transaction_id: int) -> None:
        """Raise TrimmedError (naming the partition, the id and the trim point) for an id below the trim
        point: no replica is asked, and none needs to hold it."""
        if 0 <= transaction_id < self.trim_point:
            raise TrimmedError.below(self.partition_id, transaction_id, self.trim_point)

    def set_trim_point(self, trim_point: int) -> None:
        """Raise the trim point (a lower one is ignored) and tell the open session's replicas."""
        if trim_point <= self.trim_point:
            return
        self.trim_point = trim_point
        self._trim_wanted.set()

    async def _trim_loop(self) -> None:
        """Tell the open session's replicas the trim point whenever it rises or a session opens."""
        while True:
            await self._trim_wanted.wait()
            self._trim_wanted.clear()
            session = self._session
            if session is not None and session.is_open and self.trim_point > 0:
                await tell_replicas(session, self.trim_point)

    async def _read(self, read: Callable[[StoreSession], Awaitable[R]]) -> R:
        backoff = self._backoff()
        error: WaltzError = PartitionNotReadyError(f"partition {self.partition_id} has no open store session")
        for _ in range(self.config.max_read_attempts):
            session = self._session
            if session is not None and session.is_open:
                try:
                    return await read(session)
                except WaltzError as e:
                    error = e
            await backoff.sleep()
        raise error

    # -- the supervisor --------------------------------------------------------------------------------------

    def _backoff(self) -> Backoff:
        return Backoff(self._rng, self.config.initial_retry_interval_ms, self.config.max_retry_interval_ms)

    async def _supervise(self) -> None:
        backoff = self._backoff()
        retry_log = RetryLog(log)
        while True:
            if self._stale:
                self._fail_everything(
                    GenerationMismatchError(f"partition {self.partition_id} moved to a newer generation")
                )
                self._generation_raised.clear()
                await self._wait_for_newer_generation()
                continue
            try:
                session = await self._new_session()
            except GenerationMismatchError as e:
                log.warning("partition %d: %s", self.partition_id, e)
                self._stale = True
                self._stale_detail = str(e)
                continue
            except WaltzError as e:
                retry_log.log(
                    logging.WARNING, "partition %d: cannot start a store session: %r", self.partition_id, e
                )
                await backoff.sleep()
                continue
            self._session = session
            outcome: SessionOutcome | None = None
            try:
                outcome = await session.run()
            except Exception as e:
                # A bug: keep the log, count it (the simulator fails on it), and try again with a new session.
                log.exception("partition %d: store session %d failed", self.partition_id, session.session_id)
                self.internal_errors.append(e)
            finally:
                self._session = None
                # The session's batches not committed come back, to be decided by the next session to open.
                self._survivors.extend(session.take_survivors())
            if outcome is not None:
                ended = self.stats.sessions_ended
                ended[outcome.reason.value] = ended.get(outcome.reason.value, 0) + 1
                self.outcomes.append(outcome)
                del self.outcomes[:-100]
                if outcome.opened:
                    backoff.reset()
                if outcome.reason in _NO_BACKOFF:
                    continue
            await backoff.sleep()

    async def _wait_for_newer_generation(self) -> None:
        """Wait until :meth:`set_generation` raises ours. A partition that really moved is dropped by this
        server well before ``stale_report_ms``; if it is still ours by then, the metadata's generation was
        not written by any owner the assignment named (an anonymous or corrupt write): say so, loudly and in
        :meth:`statistics`, rather than sit silently unserved."""
        try:
            async with asyncio.timeout(self.config.stale_report_ms / 1000):
                await self._generation_raised.wait()
        except TimeoutError:
            self.metadata_conflict = (
                f"{self._stale_detail}, and no assignment of a newer generation reached this server in "
                f"{self.config.stale_report_ms} ms: the partition metadata in ZooKeeper was not written by "
                "an owner the assignment named (an anonymous or corrupt write; see docs/security.md); the "
                "partition stays unserved until an operator repairs the metadata or reassigns it"
            )
            log.error("partition %d: %s", self.partition_id, self.metadata_conflict)
            await self._wait_for_repair()
        self.metadata_conflict = None

    async def _wait_for_repair(self) -> None:
        """Wait for a newer assignment, or for an operator to repair the metadata (``waltz cluster
        fix-generation``): every ``stale_report_ms``, read it again, and serve again once its generation is no
        longer above ours. Only a partition already reported pays these reads."""
        while True:
            try:
                async with asyncio.timeout(self.config.stale_report_ms / 1000):
                    await self._generation_raised.wait()
                return
            except TimeoutError:
                pass
            try:
                metadata, _ = await self._metadata_store.get(self.partition_id)
            except WaltzError as e:
                log.debug("partition %d: cannot re-read the metadata: %r", self.partition_id, e)
                continue
            if metadata.generation <= self._generation:
                log.info(
                    "partition %d: the metadata's generation is %d again, not above ours (%d): repaired; "
                    "serving again",
                    self.partition_id,
                    metadata.generation,
                    self._generation,
                )
                self._stale = False
                return

    async def _new_session(self) -> StoreSession:
        """Take the next session id by a version-checked metadata write."""
        for _ in range(self.config.max_metadata_attempts):
            previous, version = await self._metadata_store.get(self.partition_id)
            if previous.generation > self._generation:
                raise GenerationMismatchError(
                    f"partition {self.partition_id} metadata is at generation {previous.generation}, "
                    f"this server has {self._generation}"
                )
            session_id = previous.session_id + 1
            claimed = PartitionMetadata(self._generation, session_id, previous.replicas)
            try:
                new_version = await self._metadata_store.compare_and_set(self.partition_id, claimed, version)
            except ConcurrentUpdateError:
                continue
            return StoreSession(
                partition_id=self.partition_id,
                generation=self._generation,
                session_id=session_id,
                replicas=self._replicas,
                previous=previous,
                metadata_version=new_version,
                connector=self._connector,
                metadata_store=self._metadata_store,
                rng=self._rng,
                config=self.config,
                host=self,
            )
        raise ConcurrentUpdateError(f"partition {self.partition_id}: metadata kept changing")

    # -- SessionHost -----------------------------------------------------------------------------------------

    async def session_opened(self, session: StoreSession) -> None:
        """Resolve the appends a failed session left in flight against ``session``'s low-water mark."""
        stats = self.stats
        stats.sessions_opened += 1
        stats.recovery_seconds_sum += session.recovery_ms / 1000
        stats.last_recovery_seconds = session.recovery_ms / 1000
        lwm = session.low_water_mark
        if lwm < self._hwm:
            raise InvariantViolation(
                f"partition {self.partition_id}: session {session.session_id} opened at {lwm}, "
                f"below the committed high-water mark {self._hwm}"
            )
        committed: dict[int, RecordHeader] = {}
        candidates = [p for p in self._survivors if 0 <= p.transaction_id <= lwm]
        if candidates:
            next_id = min(p.transaction_id for p in candidates)
            last = max(p.transaction_id for p in candidates)
            while next_id <= last:
                try:
                    headers = await session.read_headers(next_id, last - next_id + 1)
                except WaltzError:
                    raise SessionOver from None
                for stored in headers:
                    committed[stored.transaction_id] = stored
                next_id = headers[-1].transaction_id + 1
        self._hwm = lwm
        self._trim_wanted.set()
        self._session_changed.set()
        survivors, self._survivors = self._survivors, []
        resolved = 0
        for pending in survivors:
            found = committed.get(pending.transaction_id)
            if found is not None and found.req_id == pending.req_id:
                resolved += pending.succeed()
            else:
                resolved += pending.fail(
                    QuorumLostError(
                        f"append {pending.req_id!r} (id {pending.transaction_id} in session "
                        f"{pending.session_id}) did not commit; session {session.session_id} opened at {lwm}"
                    )
                )
        self._resolved += resolved
        self._resolutions.set()

    def replica_joined(self, session: StoreSession, storage: str) -> None:
        # A replica that joins an open session late missed the trim point sent at the opening: without this it
        # would keep what is below it (its disk not reclaimed) until the next session, which may be days away.
        if session is self._session and self.trim_point > 0:
            self._trim_wanted.set()

    def batch_committed(self, session: StoreSession, appends: Sequence[PendingAppend]) -> None:
        hwm = session.high_water_mark
        if hwm <= self._hwm:
            raise InvariantViolation(f"partition {self.partition_id}: commit at {hwm} after {self._hwm}")
        self._hwm = hwm
        n = len(appends)
        stats = self.stats
        stats.batch_appends_sum += n
        bucket = (n - 1).bit_length()
        stats.batch_appends_counts[bucket if bucket < _LAST_BATCH_BUCKET else _LAST_BATCH_BUCKET] += 1
        listener: AppendListener | None = None
        heard: list[PendingAppend] = []
        skipped = 0
        for pending in appends:
            if pending.resolved:
                skipped += 1
                continue
            pending.resolved = True
            if pending.listener is not listener:
                # Appends of one listener are told together (the server's partition is the only listener of
                # its store: one call per batch); a batch that mixes listeners tells each its run in order.
                if heard:
                    _tell_committed(listener, heard)  # type: ignore[arg-type]
                    heard = []
                listener = pending.listener
            heard.append(pending)
        self._resolved += n - skipped
        if heard:
            _tell_committed(listener, heard)  # type: ignore[arg-type]
        if self._resolution_awaited:
            self._resolution_awaited = False
            self._resolutions.set()

    def _fail_everything(self, error: WaltzError) -> None:
        """Fail every append not resolved yet (survivors of failed sessions and queued appends; a session's
        batches came back as survivors when it stopped) and wake the producers waiting for room: the
        partition stops writing."""
        survivors, self._survivors = self._survivors, []
        resolved = 0
        for pending in survivors + self.queue.clear():
            resolved += pending.fail(error)
        self._resolved += resolved
        self._resolutions.set()

    def replica_damaged(self, storage: str, detail: str) -> None:
        """SessionHost: count and log a read that found ``storage``'s stored copy damaged."""
        first = storage not in self.damaged_replicas
        self.damaged_replicas[storage] = self.damaged_replicas.get(storage, 0) + 1
        # One line per replica, then every 100th: a scan over a damaged range must not flood the log.
        if first or self.damaged_replicas[storage] % 100 == 0:
            log.error(
                "partition %d: replica %s holds a damaged record (%d reads so far); reading another replica "
                "and repairing it: %s",
                self.partition_id,
                storage,
                self.damaged_replicas[storage],
                detail,
            )

    # -- introspection ---------------------------------------------------------------------------------------

    def statistics(self) -> dict[str, object]:
        session = self._session
        return {
            "partition_id": self.partition_id,
            "generation": self._generation,
            "high_water_mark": self._hwm,
            "healthy": self.is_healthy,
            "session_id": session.session_id if session is not None else None,
            "participants": [p.storage for p in session.participants] if session is not None else [],
            "queued_appends": self.queue.qsize(),
            "inflight_appends": len(self._survivors)
            + (session.appends_in_flight if session is not None else 0),
            "sessions_ended": len(self.outcomes),
            "damaged_replica_reads": dict(self.damaged_replicas),
            "metadata_conflict": self.metadata_conflict,
        }


def _tell_committed(listener: AppendListener, appends: Sequence[PendingAppend]) -> None:
    # A failing listener is logged, and the commit goes on (as the event loop logs a failing callback).
    try:
        listener.appends_committed(appends)
    except Exception:
        log.exception("an append's resolution listener failed")
