"""Production implementations of the replication core's interfaces (:mod:`waltz.server.store.interfaces`).

* :class:`TcpReplicaConnector` shares one :class:`~waltz.server.storage_client.StorageClient` (one TCP
  connection, opened with the cluster key) per storage node among every partition of this server, and
  reconnects when that connection broke. Each :class:`TcpReplicaConnection` stamps its store session id on
  every request, so the storage node's fencing applies.
* :class:`ZkPartitionMetadataStore` reads and version-checks writes of ``<root>/store/partition/<id>`` with
  kazoo, off the event loop.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Sequence
from ssl import SSLContext

from kazoo.client import KazooClient

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.cluster.store_metadata import read_partition_metadata, write_partition_metadata
from waltz.config import host_port
from waltz.errors import BrokenResourceError, ClosedResourceError, ConfigError, WaltzError
from waltz.protocol.record_run import RunBytes
from waltz.protocol.records import Record, RecordHeader
from waltz.protocol.storage import append_request_body
from waltz.server.storage_client import StorageClient
from waltz.server.store.interfaces import ReplicaConnection, SessionInfo


class _AppendBodies:
    """The encoded records of the last batch appended: the store session hands the same records object to
    every replica of the batch, so they are encoded once, not once per replica. Keeping that object keeps
    its identity from being reused while it is cached."""

    __slots__ = ("_body", "_records")

    def __init__(self) -> None:
        self._records: Sequence[Record] | None = None
        self._body = b""

    def body_of(self, records: Sequence[Record]) -> bytes:
        if records is not self._records:
            self._body = append_request_body(records)
            self._records = records
        return self._body


class TcpReplicaConnection:
    """One partition on one storage node for one store session, over the node's shared connection."""

    def __init__(
        self,
        client: StorageClient,
        storage: str,
        partition_id: int,
        session_id: int,
        bodies: _AppendBodies | None = None,
    ) -> None:
        self._client = client
        self._storage = storage
        self._partition_id = partition_id
        self._session_id = session_id
        self._closed = False
        self._bodies = bodies if bodies is not None else _AppendBodies()
        self._loss_listener: Callable[[BaseException], None] | None = None

    @property
    def storage(self) -> str:
        return self._storage

    def on_lost(self, callback: Callable[[BaseException], None]) -> None:
        if self._closed or self._loss_listener is not None:
            raise ClosedResourceError(f"replica connection to {self._storage}: closed, or watched already")
        self._loss_listener = callback
        self._client.add_loss_listener(callback)

    def last_answer_s(self) -> float:
        return self._client.last_answer_s

    def _live(self) -> StorageClient:
        if self._closed:
            raise self._closed_error()
        if not self._client.is_usable:
            raise BrokenResourceError(f"connection to storage {self._storage} is broken")
        return self._client

    def _closed_error(self) -> ClosedResourceError:
        return ClosedResourceError(f"replica connection to {self._storage} is closed")

    async def last_session_info(self) -> SessionInfo:
        info = await self._live().last_session_info(self._session_id, self._partition_id)
        return SessionInfo(info.session_id, info.low_water_mark, info.local_low_water_mark, info.damaged)

    async def max_transaction_id(self) -> int:
        return await self._live().max_transaction_id(self._session_id, self._partition_id)

    async def truncate(self, transaction_id: int, *, reason: str = "") -> int:
        client = self._live()
        return await client.truncate(self._session_id, self._partition_id, transaction_id, reason=reason)

    async def set_low_water_mark(self, low_water_mark: int) -> None:
        await self._live().set_low_water_mark(self._session_id, self._partition_id, low_water_mark)

    async def trim(self, trim_point: int) -> int:
        return await self._live().trim(self._session_id, self._partition_id, trim_point)

    async def append(self, records: Sequence[Record]) -> None:
        client = self._live()
        await client.append_encoded(self._session_id, self._partition_id, self._bodies.body_of(records))

    def start_append(
        self, records: Sequence[Record], on_answer: Callable[[asyncio.Future[object]], None]
    ) -> asyncio.Future[object]:
        if self._closed:
            raise self._closed_error()
        body = self._bodies.body_of(records)
        # (A broken connection raises in start_call, which checks it anyway: no _live() per append.)
        return self._client.start_append_encoded(self._session_id, self._partition_id, body, on_answer)

    async def read_records(self, transaction_id: int, max_count: int) -> list[Record]:
        return await self._live().read_records(
            self._session_id, self._partition_id, transaction_id, max_count
        )

    async def read_headers(self, transaction_id: int, max_count: int) -> list[RecordHeader]:
        return await self._live().read_headers(
            self._session_id, self._partition_id, transaction_id, max_count
        )

    async def read_run(self, transaction_id: int, max_count: int, max_bytes: int) -> tuple[int, RunBytes]:
        return await self._live().read_run(
            self._session_id, self._partition_id, transaction_id, max_count, max_bytes
        )

    async def read_record(self, transaction_id: int) -> Record | None:
        return await self._live().read_record(self._session_id, self._partition_id, transaction_id)

    async def repair(self, records: Sequence[Record]) -> None:
        await self._live().repair(self._session_id, self._partition_id, records)

    async def damaged_records(self, max_ids: int) -> list[int]:
        return await self._live().damaged_records(self._session_id, self._partition_id, max_ids)

    async def segment_sizes(self, max_segments: int) -> list[tuple[int, int]]:
        return await self._live().segment_sizes(self._session_id, self._partition_id, max_segments)

    async def aclose(self) -> None:
        # The TCP connection is shared with other partitions; only this view of it closes.
        self._closed = True
        if self._loss_listener is not None:
            self._client.remove_loss_listener(self._loss_listener)
            self._loss_listener = None


class TcpReplicaConnector:
    """Opens :class:`TcpReplicaConnection`s, keeping one live StorageClient per storage node."""

    def __init__(
        self,
        cluster_key: uuid.UUID,
        num_partitions: int,
        *,
        connect_timeout_ms: int = 3_000,
        ssl: SSLContext | None = None,
    ) -> None:
        self._key = cluster_key
        self._num_partitions = num_partitions
        self._connect_timeout_ms = connect_timeout_ms
        self._ssl = ssl
        self._clients: dict[str, StorageClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._bodies = _AppendBodies()
        self._closed = False
        self._multi_append = False

    async def _client(self, storage: str) -> StorageClient:
        lock = self._locks.setdefault(storage, asyncio.Lock())
        async with lock:
            if self._closed:
                raise ClosedResourceError("replica connector is closed")
            client = self._clients.get(storage)
            if client is not None and client.is_usable:
                return client
            if client is not None:
                await client.aclose()
                del self._clients[storage]
            try:
                host, port = host_port(storage)
            except ConfigError as e:
                raise BrokenResourceError(f"bad storage connect string {storage!r}: {e}") from None
            client = await StorageClient.connect(
                host,
                port,
                self._key,
                self._num_partitions,
                connect_timeout_ms=self._connect_timeout_ms,
                ssl=self._ssl,
            )
            client.multi_append = self._multi_append
            self._clients[storage] = client
            return client

    def allow_multi_append(self, allowed: bool) -> None:
        """Whether the cluster's feature version allows MultiAppendRequests (to nodes that speak storage
        codec V2; see :class:`StorageClient`): for the connections open now and later."""
        self._multi_append = allowed
        for client in self._clients.values():
            client.multi_append = allowed

    async def connect(self, storage: str, partition_id: int, session_id: int) -> ReplicaConnection:
        client = await self._client(storage)
        return TcpReplicaConnection(client, storage, partition_id, session_id, self._bodies)

    def reachable(self) -> dict[str, bool]:
        """Storage nodes this server has talked to, and whether their connection is up."""
        return {s: c.is_usable for s, c in sorted(self._clients.items())}

    async def probe(self, storages: Iterable[str]) -> dict[str, bool]:
        """Whether each of ``storages`` (and every node talked to before) can be reached now: an existing
        usable connection counts, otherwise one is opened (within the connect timeout), concurrently."""
        names = sorted(set(storages) | set(self._clients))

        async def one(storage: str) -> bool:
            try:
                await self._client(storage)
            except (WaltzError, OSError):
                return False
            return True

        results = await asyncio.gather(*(one(s) for s in names))
        return dict(zip(names, results, strict=True))

    async def aclose(self) -> None:
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()


class ZkPartitionMetadataStore:
    """``<root>/store/partition/<id>`` on ZooKeeper, read and compare-and-set off the event loop."""

    def __init__(self, client: KazooClient, root: str) -> None:
        self._client = client
        self._root = root

    async def get(self, partition_id: int) -> tuple[PartitionMetadata, int]:
        return await asyncio.to_thread(read_partition_metadata, self._client, self._root, partition_id)

    async def compare_and_set(
        self, partition_id: int, metadata: PartitionMetadata, expected_version: int
    ) -> int:
        return await asyncio.to_thread(
            write_partition_metadata, self._client, self._root, partition_id, metadata, expected_version
        )
