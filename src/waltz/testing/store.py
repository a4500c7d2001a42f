"""In-memory storage nodes, network and metadata store, faithful enough to test the replication core.

:class:`MemoryStorage` follows the storage node's rules (REFERENCE §2.1, §3):

* **Fencing.** Each partition keeps an in-memory session id, initialised from the persisted control info. On
  the *arrival* of any message it becomes ``max(current, message session)``; when the message is processed it
  fails with :class:`SessionFencedError` unless its session equals the current one.
* **Ordered processing.** Each partition processes its messages one at a time in arrival order; messages of
  one connection arrive in the order they were sent.
* **Durability.** An append writes its records, then fsyncs (taking ``fsync_ms``), then answers. A crash
  before the fsync completes keeps an arbitrary prefix of the unsynced records (the OS may have flushed some)
  and loses the rest. Truncate, SetLowWaterMark and Trim are durable when they answer. The persisted control
  info is ``(session id, low-water mark, local low-water mark, trim point)``.

There are no tasks here: the network and the nodes run on ``loop.call_at`` timers, so nothing a caller cancels
can interrupt a node mid-operation (a node, like a real one, finishes what it received), and a run on the
simulator's virtual-time loop is deterministic.

:class:`MemoryNetwork` decides delays and faults: each message gets a delay drawn from the injected random
source (connections stay FIFO); a message may be lost, which breaks the connection (as a TCP reset would)
after ``failure_detection_ms``, the request being delivered or not at random; a node may be isolated.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.errors import (
    BrokenResourceError,
    ClosedResourceError,
    ClusterError,
    ConcurrentUpdateError,
    CorruptionError,
    PartitionNotAssignedError,
    SessionFencedError,
    StorageError,
    StorageRpcError,
    TransactionOutOfOrderError,
    TrimmedError,
    WaltzError,
)
from waltz.protocol.record_run import RunBytes, encode_run, stored_size
from waltz.protocol.records import Record, RecordHeader, ReqId
from waltz.server.store.interfaces import SessionInfo

__all__ = [
    "MemoryConnection",
    "MemoryConnector",
    "MemoryMetadataStore",
    "MemoryNetwork",
    "MemoryStorage",
    "NullConnector",
    "NullReplica",
    "StorageSnapshot",
]

_FIFO_STEP_S = 1e-6
"""Minimum spacing of two arrivals on one connection, so timer ties never reorder a connection's messages."""


class MemoryNetwork:
    """Delays, losses and isolation of the links between servers and memory storage nodes.

    With the defaults every message is delivered at once and never lost.
    """

    def __init__(
        self,
        rng: random.Random | None = None,
        *,
        min_delay_ms: float = 0.0,
        max_delay_ms: float = 0.0,
        loss_probability: float = 0.0,
        failure_detection_ms: float = 50.0,
    ) -> None:
        self.rng = rng if rng is not None else random.Random(0)
        self.min_delay_ms = min_delay_ms
        self.max_delay_ms = max_delay_ms
        self.loss_probability = loss_probability
        self.failure_detection_ms = failure_detection_ms
        self._isolated: dict[str, bool] = {}
        self.storages: dict[str, MemoryStorage] = {}
        self.messages_lost = 0

    def add(self, storage: MemoryStorage) -> MemoryStorage:
        """Make ``storage`` reachable under its name."""
        self.storages[storage.name] = storage
        return storage

    def delay_s(self) -> float:
        if self.max_delay_ms <= 0:
            return 0.0
        return self.rng.uniform(self.min_delay_ms, self.max_delay_ms) / 1000

    def lose(self) -> bool:
        """Whether the next message is lost (breaking its connection)."""
        if self.loss_probability <= 0 or self.rng.random() >= self.loss_probability:
            return False
        self.messages_lost += 1
        return True

    def isolate(self, name: str) -> None:
        """Cut ``name`` off: its connections break and new ones cannot be opened until :meth:`heal`."""
        self._isolated[name] = True
        storage = self.storages.get(name)
        if storage is not None:
            storage.break_connections()

    def heal(self, name: str) -> None:
        self._isolated.pop(name, None)

    def is_isolated(self, name: str) -> bool:
        return self._isolated.get(name, False)


@dataclass
class _Request:
    kind: str
    session_id: int
    args: tuple[Any, ...]


@dataclass
class _PartitionState:
    records: list[Record] = field(default_factory=list)
    synced: int = 0
    """How many of ``records`` are durable; the rest were written by an append still fsyncing."""
    persisted_session_id: int = -1
    low_water_mark: int = -1
    local_low_water_mark: int = -1
    session_id: int = -1
    """The in-memory fencing session id (max of arrivals since the last start)."""
    inbox: deque[tuple[MemoryConnection, int, _Request]] = field(default_factory=deque)
    busy: bool = False
    mutation_sessions: list[int] = field(default_factory=list)
    """Session id of every processed truncate/append/set-low-water-mark, in order (for invariant checks)."""
    rewrites: int = 0
    """How many times records were removed or replaced (truncate, crash, restore): a checker that verified a
    prefix of ``records`` may keep trusting it while this is unchanged, since appends only add at the end."""
    damaged: set[int] = field(default_factory=set)
    """Ids whose stored copy is damaged (``MemoryStorage.damage``): reads of them fail; a repair heals."""
    trim_point: int = 0
    """Reads below it fail with TrimmedError, as on a storage node (the records stay: nothing here counts
    bytes)."""
    log_start: int = 0
    """The first id the log holds: a replica that restarted at a trim point holds only fillers below it, and a
    truncation never cuts below it (as a node's never cuts its first segment)."""

    @property
    def max_transaction_id(self) -> int:
        return len(self.records) - 1


@dataclass(frozen=True)
class StorageSnapshot:
    """A consistent backup of a node's durable state (records and control info of every partition)."""

    partitions: dict[int, tuple[tuple[Record, ...], int, int, int, int, int]]
    """Per partition: (durable records, session id, low-water mark, local low-water mark, trim point, first id
    of the log)."""


_MUTATIONS = ("truncate", "append", "set_low_water_mark")
_WRITES = (*_MUTATIONS, "repair", "trim")
"""The requests that change a replica (the mutations are those a storage node syncs before it answers)."""


class MemoryStorage:
    """One storage node holding ``num_partitions`` partitions in memory (see the module docstring)."""

    def __init__(
        self,
        name: str,
        num_partitions: int,
        network: MemoryNetwork,
        *,
        fsync_ms: tuple[float, float] = (0.0, 0.0),
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self.network = network
        self.fsync_ms = fsync_ms
        self.rng = rng if rng is not None else random.Random(0)
        self.up = True
        self.incarnation = 0
        self.partitions: dict[int, _PartitionState] = {p: _PartitionState() for p in range(num_partitions)}
        self._connections: list[MemoryConnection] = []
        self.out_of_order_appends = 0
        self.last_answer_s = float("-inf")
        """When any connection last got an answer from this node (a server's partitions share one link to a
        node: this is what the link's liveness looks like)."""
        self.requests: collections.Counter[str] = collections.Counter()
        """Requests that reached this node, by kind."""
        network.add(self)

    # -- fault injection -------------------------------------------------------------------------------------

    def crash(self) -> None:
        """Stop at once: unsynced records survive only as a random prefix, in-memory state is lost."""
        if not self.up:
            return
        self.up = False
        self.incarnation += 1
        for part in self.partitions.values():
            unsynced = len(part.records) - part.synced
            keep = self.rng.randint(0, unsynced) if unsynced else 0
            del part.records[part.synced + keep :]
            part.synced = len(part.records)
            part.rewrites += 1
            part.inbox.clear()
            part.busy = False
            part.session_id = part.persisted_session_id
        self.break_connections()

    def damage(self, partition_id: int, transaction_id: int) -> None:
        """Damage one stored record, as a flipped bit that the node's scrub found: reads that cover it fail
        with CorruptionError and ``damaged_records`` reports it, until a repair sends the good copy."""
        part = self.partitions[partition_id]
        if not 0 <= transaction_id <= part.max_transaction_id:
            raise ValueError(f"{self.name} does not hold transaction {transaction_id}")
        part.damaged.add(transaction_id)

    def restart(self) -> None:
        if not self.up:
            self.up = True
            for part in self.partitions.values():
                part.session_id = part.persisted_session_id

    def snapshot(self) -> StorageSnapshot:
        """A backup of the durable state, as a file-system snapshot would take it."""
        return StorageSnapshot(
            {
                pid: (
                    tuple(part.records[: part.synced]),
                    part.persisted_session_id,
                    part.low_water_mark,
                    part.local_low_water_mark,
                    part.trim_point,
                    part.log_start,
                )
                for pid, part in self.partitions.items()
            }
        )

    def restore(self, snapshot: StorageSnapshot) -> None:
        """Replace the durable state by ``snapshot`` (only while the node is down)."""
        if self.up:
            raise RuntimeError("restore a snapshot only while the storage node is down")
        for pid, (records, session_id, lwm, local_lwm, trim_point, log_start) in snapshot.partitions.items():
            part = self.partitions[pid]
            part.records = list(records)
            part.rewrites += 1
            part.synced = len(records)
            part.persisted_session_id = session_id
            part.session_id = session_id
            part.low_water_mark = lwm
            part.local_low_water_mark = local_lwm
            part.trim_point = trim_point
            part.log_start = log_start

    def break_connections(self) -> None:
        connections, self._connections = self._connections, []
        for conn in connections:
            conn.break_()

    # -- message handling ------------------------------------------------------------------------------------

    def _register(self, conn: MemoryConnection) -> None:
        self._connections.append(conn)

    def _unregister(self, conn: MemoryConnection) -> None:
        if conn in self._connections:
            self._connections.remove(conn)

    def _reachable(self, conn: MemoryConnection) -> bool:
        return self.up and conn.incarnation == self.incarnation and not self.network.is_isolated(self.name)

    def _arrive(self, conn: MemoryConnection, rid: int, request: _Request) -> None:
        if not self._reachable(conn):
            return
        self.requests[request.kind] += 1
        part = self.partitions.get(conn.partition_id)
        if part is None:
            conn._respond(
                rid, None, PartitionNotAssignedError(f"Partition:{conn.partition_id} is not assigned.")
            )
            return
        # The fencing rule: arrival raises the partition's session id; processing checks equality.
        part.session_id = max(part.session_id, request.session_id)
        part.inbox.append((conn, rid, request))
        self._process(part)

    def _process(self, part: _PartitionState) -> None:
        loop = asyncio.get_running_loop()
        while part.inbox and not part.busy:
            conn, rid, request = part.inbox.popleft()
            try:
                result = self._execute(part, request)
            except WaltzError as e:
                conn._respond(rid, None, e)
                continue
            if request.kind in _MUTATIONS:
                part.busy = True
                loop.call_later(self._fsync_s(), self._synced, self.incarnation, part, conn, rid, result)
            else:
                conn._respond(rid, result, None)

    def _synced(
        self, incarnation: int, part: _PartitionState, conn: MemoryConnection, rid: int, result: Any
    ) -> None:
        if incarnation != self.incarnation:
            return  # the node crashed while fsyncing; crash() already decided what survived
        part.synced = len(part.records)
        part.busy = False
        conn._respond(rid, result, None)
        self._process(part)

    def _fsync_s(self) -> float:
        low, high = self.fsync_ms
        return (self.rng.uniform(low, high) if high > 0 else 0.0) / 1000

    def _execute(self, part: _PartitionState, request: _Request) -> Any:
        if request.session_id != part.session_id:
            raise SessionFencedError(
                f"session {request.session_id} fenced by session {part.session_id} on {self.name}"
            )
        kind, args = request.kind, request.args
        if kind in _MUTATIONS:
            part.mutation_sessions.append(request.session_id)
        if kind in _WRITES:
            return self._write(part, request.session_id, kind, args)
        return self._answer(part, kind, args)

    def _write(self, part: _PartitionState, session_id: int, kind: str, args: tuple[Any, ...]) -> Any:
        """Carry out a request of :data:`_WRITES` on ``part``, as a storage node does."""
        if kind == "truncate":
            (txn,) = args
            if txn < part.low_water_mark and txn < part.max_transaction_id:
                # As a storage node: committed records (at or below the low-water mark) are never cut.
                raise StorageRpcError(
                    f"refusing to truncate to {txn}, below the low-water mark {part.low_water_mark}"
                )
            # As a storage node: the log's first segment is never cut, so a log that restarted at a trim point
            # keeps up to the id below it.
            del part.records[max(txn + 1, part.log_start, 0) :]
            part.damaged = {t for t in part.damaged if t <= txn}
            part.rewrites += 1
            part.synced = min(part.synced, len(part.records))
            return part.max_transaction_id
        if kind == "set_low_water_mark":
            (lwm,) = args
            if lwm < part.low_water_mark:
                raise StorageRpcError(f"low-water mark {lwm} below persisted {part.low_water_mark}")
            if part.max_transaction_id > lwm:
                raise StorageRpcError(
                    f"max transaction id {part.max_transaction_id} above low-water mark {lwm}"
                )
            part.persisted_session_id = session_id
            part.low_water_mark = lwm
            part.local_low_water_mark = part.max_transaction_id
            return None
        if kind == "append":
            (records,) = args
            expected = part.max_transaction_id + 1
            for i, rec in enumerate(records):
                if rec.transaction_id != expected + i:
                    self.out_of_order_appends += 1
                    raise TransactionOutOfOrderError(
                        f"transaction out of order: expected {expected + i}, got {rec.transaction_id}"
                    )
                if not rec.verify():
                    raise CorruptionError(f"record {rec.transaction_id} fails its checksum")
            part.records.extend(records)
            return None
        if kind == "repair":
            # A memory replica keeps the good copy of a record it reports damaged: a repair must match it.
            (records,) = args
            for rec in records:
                if not 0 <= rec.transaction_id < len(part.records) or part.records[rec.transaction_id] != rec:
                    raise StorageRpcError(f"repair of transaction {rec.transaction_id} does not match")
                part.damaged.discard(rec.transaction_id)
            return None
        if kind == "trim":
            (trim_point,) = args
            if trim_point < 0:
                raise StorageError(f"trim point {trim_point} is negative")
            trim_point = max(trim_point, part.trim_point)
            if trim_point > part.max_transaction_id + 1:
                # A lagging replica restarts at the trim point: ids below it are never read, so fillers do.
                filler = [Record.build(i, ReqId(0, i), 0, b"") for i in range(len(part.records), trim_point)]
                part.records.extend(filler)
                part.synced = len(part.records)
                part.rewrites += 1
                part.log_start = trim_point
            part.trim_point = trim_point
            return part.trim_point
        raise StorageRpcError(f"unknown request {kind}")  # pragma: no cover - _WRITES names the kinds above

    def _answer(self, part: _PartitionState, kind: str, args: tuple[Any, ...]) -> Any:
        """Answer a request that reads ``part`` (or raise StorageRpcError for an unknown one)."""
        if kind.startswith("read_") and 0 <= args[0] < part.trim_point:
            raise TrimmedError.below(-1, args[0], part.trim_point)
        if kind == "last_session_info":
            return SessionInfo(part.persisted_session_id, part.low_water_mark, part.local_low_water_mark)
        if kind == "max_transaction_id":
            return part.max_transaction_id
        if kind == "read_records":
            txn, max_count = args
            return self._read(part, txn, max_count)
        if kind == "read_run":
            txn, max_count, max_bytes = args
            records = self._read(part, txn, max_count)
            kept, size = 0, 0
            for rec in records:
                size += stored_size(rec)
                if kept and size > max_bytes:
                    break
                kept += 1
            return kept, encode_run(records[:kept])
        if kind == "read_headers":
            txn, max_count = args
            return [r.header_only() for r in self._read(part, txn, max_count)]
        if kind == "read_record":
            (txn,) = args
            found = self._read(part, txn, 1)
            return found[0] if found else None
        if kind == "damaged_records":
            (max_ids,) = args
            return sorted(part.damaged)[: max(0, max_ids)]
        if kind == "segment_sizes":
            # One segment per 100 ids, sized as stored (the records below the trim point are not counted).
            sizes: dict[int, int] = {}
            for rec in part.records[part.trim_point : part.synced]:
                first = max(part.trim_point, rec.transaction_id // 100 * 100)
                sizes[first] = sizes.get(first, 0) + stored_size(rec)
            return sorted(sizes.items())[-max(0, args[0]) :] if args[0] > 0 else []
        raise StorageRpcError(f"unknown request {kind}")

    @staticmethod
    def _read(part: _PartitionState, txn: int, max_count: int) -> list[Record]:
        # Only durable records are visible: an append's records become readable once fsynced, which is also
        # when the next message of the partition can be processed.
        if txn < 0:
            return []
        end = min(txn + max(max_count, 0), part.synced)
        for damaged in part.damaged:
            if txn <= damaged < end:
                raise CorruptionError(f"stored transaction {damaged} fails its checksum")
        return part.records[txn:end]

    # -- introspection for tests -----------------------------------------------------------------------------

    def durable_records(self, partition_id: int) -> list[Record]:
        part = self.partitions[partition_id]
        return part.records[: part.synced]

    def session_info(self, partition_id: int) -> SessionInfo:
        part = self.partitions[partition_id]
        return SessionInfo(part.persisted_session_id, part.low_water_mark, part.local_low_water_mark)


class MemoryConnection:
    """A connection to one partition of a :class:`MemoryStorage` for one session id."""

    def __init__(self, node: MemoryStorage, partition_id: int, session_id: int) -> None:
        self._node = node
        self._network = node.network
        self.partition_id = partition_id
        self.session_id = session_id
        self.incarnation = node.incarnation
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_rid = 0
        self._last_arrival = 0.0
        self._last_response = 0.0
        self._broken = False
        self._closed = False
        self._on_lost: Callable[[BaseException], None] | None = None
        node._register(self)

    @property
    def storage(self) -> str:
        return self._node.name

    def break_(self) -> None:
        """Break the connection: pending and later requests fail with BrokenResourceError."""
        if self._broken:
            return
        self._broken = True
        self._node._unregister(self)
        delay = self._network.failure_detection_ms / 1000
        loop = asyncio.get_running_loop()
        for future in list(self._pending.values()):
            loop.call_later(delay, _fail, future, BrokenResourceError(f"connection to {self.storage} broke"))
        if self._on_lost is not None:
            loop.call_later(delay, self._lost)

    def _lost(self) -> None:
        if self._on_lost is not None and not self._closed:
            self._on_lost(BrokenResourceError(f"connection to {self.storage} broke"))

    def on_lost(self, callback: Callable[[BaseException], None]) -> None:
        if self._closed or self._on_lost is not None:
            raise ClosedResourceError(f"connection to {self.storage}: closed, or watched already")
        self._on_lost = callback
        if self._broken:
            delay = self._network.failure_detection_ms / 1000
            asyncio.get_running_loop().call_later(delay, self._lost)

    def last_answer_s(self) -> float:
        return self._node.last_answer_s

    def _respond(self, rid: int, result: Any, error: WaltzError | None) -> None:
        if self._broken or self._closed or self._network.is_isolated(self._node.name):
            return
        future = self._pending.get(rid)
        if future is None:
            return
        loop = asyncio.get_running_loop()
        when = max(loop.time() + self._network.delay_s(), self._last_response + _FIFO_STEP_S)
        self._last_response = when
        loop.call_at(when, self._settle, future, result, error)

    def _settle(self, future: asyncio.Future[Any], result: Any, error: WaltzError | None) -> None:
        if not self._broken and not self._closed and not self._network.is_isolated(self._node.name):
            self._node.last_answer_s = asyncio.get_running_loop().time()
        _settle(future, result, error)

    async def _call(self, kind: str, *args: Any) -> Any:
        if self._closed:
            raise ClosedResourceError(f"connection to {self.storage} is closed")
        if self._broken:
            raise BrokenResourceError(f"connection to {self.storage} is broken")
        loop = asyncio.get_running_loop()
        rid = self._next_rid
        self._next_rid += 1
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[rid] = future
        request = _Request(kind, self.session_id, args)
        deliver = True
        if self._network.lose():
            deliver = self._network.rng.random() < 0.5  # lost on the way there, or the answer is lost
            self.break_()
        if deliver:
            when = max(loop.time() + self._network.delay_s(), self._last_arrival + _FIFO_STEP_S)
            self._last_arrival = when
            loop.call_at(when, self._node._arrive, self, rid, request)
        try:
            return await future
        finally:
            del self._pending[rid]

    async def last_session_info(self) -> SessionInfo:
        info: SessionInfo = await self._call("last_session_info")
        return info

    async def max_transaction_id(self) -> int:
        result: int = await self._call("max_transaction_id")
        return result

    async def truncate(self, transaction_id: int, *, reason: str = "") -> int:
        result: int = await self._call("truncate", transaction_id)
        return result

    async def set_low_water_mark(self, low_water_mark: int) -> None:
        await self._call("set_low_water_mark", low_water_mark)

    async def append(self, records: Sequence[Record]) -> None:
        await self._call("append", tuple(records))

    def start_append(
        self, records: Sequence[Record], on_answer: Callable[[asyncio.Future[object]], None]
    ) -> asyncio.Future[object]:
        # As the TCP adapter does: a connection already known broken or closed refuses at once, not in the
        # future, so the simulator exercises the caller's handling of both.
        if self._closed:
            raise ClosedResourceError(f"connection to {self.storage} is closed")
        if self._broken:
            raise BrokenResourceError(f"connection to {self.storage} is broken")
        future: asyncio.Future[object] = asyncio.ensure_future(self.append(records))
        future.add_done_callback(on_answer)
        return future

    async def read_records(self, transaction_id: int, max_count: int) -> list[Record]:
        result: list[Record] = await self._call("read_records", transaction_id, max_count)
        return result

    async def read_headers(self, transaction_id: int, max_count: int) -> list[RecordHeader]:
        result: list[RecordHeader] = await self._call("read_headers", transaction_id, max_count)
        return result

    async def read_run(self, transaction_id: int, max_count: int, max_bytes: int) -> tuple[int, RunBytes]:
        result: tuple[int, RunBytes] = await self._call("read_run", transaction_id, max_count, max_bytes)
        return result

    async def read_record(self, transaction_id: int) -> Record | None:
        result: Record | None = await self._call("read_record", transaction_id)
        return result

    async def repair(self, records: Sequence[Record]) -> None:
        await self._call("repair", records)

    async def damaged_records(self, max_ids: int) -> list[int]:
        result: list[int] = await self._call("damaged_records", max_ids)
        return result

    async def trim(self, trim_point: int) -> int:
        result: int = await self._call("trim", trim_point)
        return result

    async def segment_sizes(self, max_segments: int) -> list[tuple[int, int]]:
        result: list[tuple[int, int]] = await self._call("segment_sizes", max_segments)
        return result

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._node._unregister(self)
        for future in list(self._pending.values()):
            _fail(future, ClosedResourceError(f"connection to {self.storage} was closed"))


def _settle(future: asyncio.Future[Any], result: Any, error: WaltzError | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _fail(future: asyncio.Future[Any], error: WaltzError) -> None:
    if not future.done():
        future.set_exception(error)


class MemoryConnector:
    """Opens :class:`MemoryConnection` objects to the nodes of a :class:`MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork) -> None:
        self.network = network

    async def connect(self, storage: str, partition_id: int, session_id: int) -> MemoryConnection:
        node = self.network.storages.get(storage)
        if node is None or not node.up or self.network.is_isolated(storage):
            # A refused or timed-out connect takes a while to be noticed.
            await asyncio.sleep(self.network.failure_detection_ms / 1000)
            raise BrokenResourceError(f"cannot connect to storage {storage}")
        return MemoryConnection(node, partition_id, session_id)


class NullReplica:
    """A replica connection that holds nothing: it remembers the last id it was sent and acknowledges each
    append ``connector.ack_s`` later (its answer callback runs where the answer resolves the future, as the
    TCP connection's does). Reads find nothing. For measuring a server partition on its own, its store
    included (``bench/server_path.py``, ``tests/unit/test_server_memory.py``)."""

    def __init__(self, storage: str, connector: NullConnector) -> None:
        self.storage = storage
        self._connector = connector
        self._max_id = -1
        self._loop = asyncio.get_running_loop()

    def on_lost(self, callback: Callable[[BaseException], None]) -> None:
        pass  # never lost

    def last_answer_s(self) -> float:
        return self._loop.time()  # always alive

    async def last_session_info(self) -> SessionInfo:
        return SessionInfo(-1, -1, -1)

    async def max_transaction_id(self) -> int:
        return self._max_id

    async def truncate(self, transaction_id: int) -> int:
        return self._max_id

    async def set_low_water_mark(self, low_water_mark: int) -> None:
        pass

    async def append(self, records: Sequence[Record]) -> None:
        self._max_id = records[-1].transaction_id

    def start_append(
        self, records: Sequence[Record], on_answer: Callable[[asyncio.Future[object]], None]
    ) -> asyncio.Future[object]:
        connector = self._connector
        if connector.on_append is not None:
            connector.on_append(records)
        self._max_id = records[-1].transaction_id
        future: asyncio.Future[object] = self._loop.create_future()
        self._loop.call_later(connector.ack_s, self._ack, future, on_answer)
        return future

    @staticmethod
    def _ack(future: asyncio.Future[object], on_answer: Callable[[asyncio.Future[object]], None]) -> None:
        if not future.done():
            future.set_result(None)
            on_answer(future)

    async def read_headers(self, transaction_id: int, max_count: int) -> list[RecordHeader]:
        return []

    async def damaged_records(self, max_ids: int) -> list[int]:
        return []

    async def aclose(self) -> None:
        pass


class NullConnector:
    """Opens a :class:`NullReplica` to any storage node. ``ack_s``: how long a replica takes to acknowledge
    an append; ``on_append`` (if set) is called with the records of every append sent to a replica (a bench
    encodes them there, as a storage connection would)."""

    def __init__(self, ack_s: float = 0.0001) -> None:
        self.ack_s = ack_s
        self.on_append: Callable[[Sequence[Record]], None] | None = None

    async def connect(self, storage: str, partition_id: int, session_id: int) -> NullReplica:
        return NullReplica(storage, self)


class MemoryMetadataStore:
    """The partition metadata znodes, in memory, with ZooKeeper's version-checked writes.

    Values go through :meth:`PartitionMetadata.encode`/``decode`` so the codec is exercised as with ZooKeeper.
    ``delay`` (if given) returns a latency in milliseconds for each call.

    :meth:`disconnect` models a lost ZooKeeper connection (a pause, a partition, an expiring session): every
    call then fails with :class:`ClusterError`, as the production store translates ``ConnectionLoss`` and
    ``SessionExpiredError``. A write in flight when the connection drops fails too, but was applied or not
    (``rng`` decides; without one it was not): the writer cannot tell, as with ZooKeeper.
    """

    def __init__(self, delay: Callable[[], float] | None = None, rng: random.Random | None = None) -> None:
        self._nodes: dict[int, tuple[bytes, int]] = {}
        self._delay = delay
        self._rng = rng
        self.writes = 0
        self.connected = True

    def disconnect(self) -> None:
        self.connected = False

    def reconnect(self) -> None:
        self.connected = True

    def _unavailable(self, partition_id: int) -> ClusterError:
        return ClusterError(f"partition metadata {partition_id}: ZooKeeper unavailable (ConnectionLoss)")

    async def _latency(self) -> None:
        if self._delay is not None:
            await asyncio.sleep(self._delay() / 1000)

    async def get(self, partition_id: int) -> tuple[PartitionMetadata, int]:
        await self._latency()
        if not self.connected:
            raise self._unavailable(partition_id)
        return self.peek(partition_id)

    def peek(self, partition_id: int) -> tuple[PartitionMetadata, int]:
        """The current value without latency (for tests and checkers)."""
        node = self._nodes.get(partition_id)
        if node is None:
            return PartitionMetadata(), -1
        raw, version = node
        return PartitionMetadata.decode(raw), version

    async def compare_and_set(
        self, partition_id: int, metadata: PartitionMetadata, expected_version: int
    ) -> int:
        sent = self.connected
        await self._latency()
        if not self.connected:
            # Sent before the connection dropped: applied or not, the answer is lost.
            if sent and self._rng is not None and self._rng.random() < 0.5:
                with contextlib.suppress(ConcurrentUpdateError):
                    self._apply(partition_id, metadata, expected_version)
            raise self._unavailable(partition_id)
        return self._apply(partition_id, metadata, expected_version)

    def _apply(self, partition_id: int, metadata: PartitionMetadata, expected_version: int) -> int:
        current = self._nodes.get(partition_id)
        version = -1 if current is None else current[1]
        if version != expected_version:
            raise ConcurrentUpdateError(
                f"partition {partition_id} metadata is at version {version}, expected {expected_version}"
            )
        self._nodes[partition_id] = (metadata.encode(partition_id), version + 1)
        self.writes += 1
        return version + 1
