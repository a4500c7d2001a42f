"""What the replication core needs from the outside world, as abstract interfaces.

The store layer (store sessions, recovery, quorum writes) is written only against these protocols, so it runs
unchanged against in-memory storage nodes and a simulated clock (``waltz.testing.store``, ``tests/fault/``)
and against real storage nodes over TCP and a real ZooKeeper.

What an implementation must guarantee
-------------------------------------
``ReplicaConnection`` (one per (storage node, partition) for one store session id):

* Every message carries the session id the connection was opened for. The storage node applies the fencing
  rule (REFERENCE §2.1): on *arrival* of a message the partition's session id becomes
  ``max(current, message.session_id)``; when the message is processed it fails with
  :class:`~waltz.errors.SessionFencedError` unless ``message.session_id == current``.
* Messages of one connection arrive, and are processed, in the order they were sent (TCP + one worker per
  storage partition), and are answered in that order.
* Several calls may be under way at once (the store layer keeps up to ``max_inflight_batches`` appends in
  flight, each in a task started in order). A call sends its request before it first suspends, so calls
  started in order are sent in order. Breaking this costs only liveness: the node refuses an append that does
  not continue its log, and an acknowledgement out of order ends the session.
* ``append`` returns only after the records are durable (fsynced). ``truncate`` and ``set_low_water_mark`` are
  durable when they return.
* Every call returns or raises within a bounded time. A transport failure raises
  :class:`~waltz.errors.BrokenResourceError`; a failure response of the node raises the error rebuilt by
  :func:`waltz.errors.error_from_wire` (:class:`~waltz.errors.StorageRpcError` by default). After a failure
  the outcome of the request is unknown (it may or may not have been applied), and the store layer never
  reuses the connection.

``PartitionMetadataStore`` (the ZooKeeper znode ``<root>/store/partition/<id>``):

* ``get`` returns the decoded value and its version; a missing znode is ``(PartitionMetadata(), -1)``.
* ``compare_and_set`` writes only if the current version equals ``expected_version`` (``-1``: only if the
  znode does not exist yet) and returns the new version; otherwise it raises
  :class:`~waltz.errors.ConcurrentUpdateError`. Any other failure (connection loss) raises a
  :class:`~waltz.errors.ClusterError`; the store layer then re-reads before trying again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.protocol.record_run import RunBytes
from waltz.protocol.records import Record, RecordHeader, ReqId

__all__ = [
    "AppendLike",
    "PartitionMetadataStore",
    "ReplicaConnection",
    "ReplicaConnector",
    "SessionInfo",
]


@dataclass(frozen=True)
class SessionInfo:
    """The control information a storage node persisted for a partition (LastSessionInfoResponse).

    ``session_id`` is the store session that last set the low-water mark (-1 if none); ``low_water_mark`` is
    the cluster high-water mark resolved when that session started; ``local_low_water_mark`` is the replica's
    own max transaction id at that moment (it is below ``low_water_mark`` when the replica was behind).
    ``damaged``: the node found that the replica lost records it held (a power cut wiped its directory, say);
    recovery does not count it in a vote until the node reports it repaired.
    """

    session_id: int
    low_water_mark: int
    local_low_water_mark: int
    damaged: bool = False


@runtime_checkable
class ReplicaConnection(Protocol):
    """One partition on one storage node, spoken to on behalf of one store session (see module docstring)."""

    @property
    def storage(self) -> str:
        """The storage node's connect string (``host:port``), as in the partition metadata."""
        ...

    def on_lost(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` once if the link to the node (shared with other partitions) is lost while
        this connection is open (soon, if it is lost already); never after :meth:`aclose`. Once per
        connection. A node that stopped answering without closing the link is not reported: probe it."""
        ...

    def last_answer_s(self) -> float:
        """Loop time at which the node last answered anything on the link this connection shares with other
        partitions (-inf if never): it was alive then."""
        ...

    async def last_session_info(self) -> SessionInfo:
        """The persisted control info. The first message of a session, so it is also the fencing message."""
        ...

    async def max_transaction_id(self) -> int:
        """The highest transaction id stored (-1 if the partition is empty)."""
        ...

    async def truncate(self, transaction_id: int, *, reason: str = "") -> int:
        """Delete every record above ``transaction_id`` (durably); return the resulting max transaction id.

        ``reason`` (short) goes into the node's log line about the truncation. The node refuses to go below
        the replica's persisted low-water mark (committed records): recovery never asks for that."""
        ...

    async def set_low_water_mark(self, low_water_mark: int) -> None:
        """Persist ``(session id, low_water_mark, local low-water mark = current max id)``.

        The node refuses a low-water mark below the persisted one, and refuses if its max id is above it.
        """
        ...

    async def append(self, records: Sequence[Record]) -> None:
        """Append records whose ids continue the log densely; return once they are fsynced."""
        ...

    def start_append(
        self, records: Sequence[Record], on_answer: Callable[[asyncio.Future[object]], None]
    ) -> asyncio.Future[object]:
        """:meth:`append` sent now: a future done once the records are fsynced (failed as ``append`` would
        raise), with no timeout of its own (the caller bounds the time). ``on_answer(future)`` is called
        once it is done, unless the caller cancelled it: at the latest as a done callback would be."""
        ...

    async def read_records(self, transaction_id: int, max_count: int) -> list[Record]:
        """Consecutive records from ``transaction_id`` until ``max_count`` or the first missing id."""
        ...

    async def read_headers(self, transaction_id: int, max_count: int) -> list[RecordHeader]:
        """Like :meth:`read_records`, headers only."""
        ...

    async def read_run(self, transaction_id: int, max_count: int, max_bytes: int) -> tuple[int, RunBytes]:
        """Like :meth:`read_records`, but the records as stored (a record run, its shape checked here, each
        record checksum by the node; :mod:`waltz.protocol.record_run`) and at most ``max_bytes`` beyond the
        first: ``(count, run)``. A damaged stored copy raises CorruptionError."""
        ...

    async def read_record(self, transaction_id: int) -> Record | None:
        """One record, or None if the node does not hold that id."""
        ...

    async def repair(self, records: Sequence[Record]) -> None:
        """Give the node good copies of committed records it reported damaged; it overwrites only copies that
        do not verify, with records of the same id and stored length (durably)."""
        ...

    async def damaged_records(self, max_ids: int) -> list[int]:
        """Ids (lowest first, at most ``max_ids``) of stored records the node found damaged, by a read or by
        its background scrub, and has not had repaired yet."""
        ...

    async def trim(self, trim_point: int) -> int:
        """Raise the replica's trim point (it deletes what is below it and refuses reads there: see
        :mod:`waltz.storage.retention`); returns the trim point in force on the replica."""
        ...

    async def segment_sizes(self, max_segments: int) -> list[tuple[int, int]]:
        """``(first transaction id, bytes)`` of the replica's newest ``max_segments`` segments, oldest
        first (for a retention policy in bytes)."""
        ...

    async def aclose(self) -> None:
        """Release the connection. Never raises; requests still in flight fail with ClosedResourceError."""
        ...


class ReplicaConnector(Protocol):
    """Opens replica connections; a real one shares one TCP/TLS link per storage node across partitions."""

    async def connect(self, storage: str, partition_id: int, session_id: int) -> ReplicaConnection:
        """Open a connection, or raise BrokenResourceError (or another WaltzError) if the node is unreachable.

        Opening sends nothing on behalf of the session; the caller's first request is ``last_session_info``.
        """
        ...


class PartitionMetadataStore(Protocol):
    """Version-checked access to the per-partition store metadata (ZooKeeper in production)."""

    async def get(self, partition_id: int) -> tuple[PartitionMetadata, int]:
        """The current value and its version; ``(PartitionMetadata(), -1)`` if there is none yet."""
        ...

    async def compare_and_set(
        self, partition_id: int, metadata: PartitionMetadata, expected_version: int
    ) -> int:
        """Write ``metadata`` if the version is still ``expected_version``; return the new version.

        Raises ConcurrentUpdateError if the version differs.
        """
        ...


class AppendLike(Protocol):
    """The fields of an append request the store needs (the server's AppendRequest message has them)."""

    @property
    def req_id(self) -> ReqId: ...

    @property
    def header(self) -> int: ...

    @property
    def data(self) -> bytes: ...

    @property
    def checksum(self) -> int: ...
