"""``LogReader``: read committed transactions of any partition, without mounting it.

For bulk readers (the Spark data source, log replays, audits): it discovers the cluster through ZooKeeper
like the client does, then asks each partition's owning server for its high-water mark and for ranges of
committed records (codec V5 TransactionRangeRequest) over one RPC connection per server. It never mounts,
never appends and takes no client id (its requests carry client id -1), so any number of readers may run
beside the cluster's clients.

Guarantees:

* every record returned is committed, and :meth:`LogReader.read_range` / :meth:`LogReader.read` return
  records with consecutive ids from the one asked for, each with its CRC-32 checked against its data (a
  mismatch is read again, then raises :class:`~waltz.errors.DataChecksumError`);
* a partition that moves, a server that dies or a dropped connection is retried (with back-off) on the
  owner the latest assignment names, within ``client.requestTimeout`` per call;
* a partition that is not being served (no server assigned, or its owner has not opened its store since
  it took the partition, so its high-water mark is unknown) is never read as empty: every call raises the
  retriable :class:`~waltz.errors.PartitionNotReadyError` (after retrying within ``client.requestTimeout``,
  as :class:`~waltz.errors.ClientTimeoutError` whose message names the partition and the cause);
* all methods are coroutines for one event loop; a reader is not thread-safe.

Example::

    async with LogReader(ClientConfig.from_yaml("client.yaml")) as reader:
        end = await reader.high_water_mark(0)
        async for record in reader.read(0, start=0, end=end):
            print(record.transaction_id, record.header, len(record.data))
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import TypeVar

from waltz.client.config import ClientConfig
from waltz.client.discovery import Discovery, ZkDiscovery
from waltz.client.rpc import (
    RpcPool,
    retry_rpc,
    rpc_high_water_mark,
    rpc_read_range,
    rpc_read_run,
)
from waltz.cluster import zk
from waltz.cluster.store_metadata import read_store_params
from waltz.errors import ClientClosedError, ClientError, PartitionNotReadyError
from waltz.protocol.record_run import RecordRun
from waltz.protocol.records import Record

__all__ = ["DEFAULT_BATCH_SIZE", "LogReader"]

T = TypeVar("T")

DEFAULT_BATCH_SIZE = 1000
"""Records asked for per range request by :meth:`LogReader.read` (the server caps it at 10,000 and trims
large responses further)."""
READER_CLIENT_ID = -1
RPC_ATTEMPT_TIMEOUT_MS = 5000


class LogReader:
    """Reads committed records of any partition (see the module docstring). Use ``async with``."""

    def __init__(self, config: ClientConfig, *, discovery: Discovery | None = None) -> None:
        self._config = config
        self._discovery: Discovery = discovery if discovery is not None else ZkDiscovery(config)
        self._rpc = RpcPool(READER_CLIENT_ID, config.tls.client_context("client config"))
        self._opened = False
        self._closed = False
        self._cluster_key: uuid.UUID | None = None

    async def open(self) -> None:
        """Connect to ZooKeeper and read the cluster's parameters and assignment."""
        if self._opened:
            raise ClientError("the reader is already open")
        self._opened = True
        await self._discovery.open()

    async def close(self) -> None:
        """Close the server connections and the ZooKeeper session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._rpc.aclose()
        if self._opened:
            await self._discovery.close()

    async def __aenter__(self) -> LogReader:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def cluster_name(self) -> str:
        return self._discovery.cluster_name

    @property
    def num_partitions(self) -> int:
        return self._discovery.num_partitions

    async def cluster_key(self) -> uuid.UUID:
        """The cluster key: the log's identity, a UUID chosen when the cluster was created (two clusters may
        share a name, never a key). Read from ZooKeeper on first use, then cached."""
        if self._cluster_key is None:
            config = self._config

            def read() -> uuid.UUID:
                client = zk.connect(
                    config.zookeeper_connect_string,
                    session_timeout_ms=config.zookeeper_session_timeout_ms,
                    auth=config.zookeeper_auth(),
                )
                try:
                    return read_store_params(client, config.cluster_root).cluster_key
                finally:
                    zk.close(client)

            self._cluster_key = await asyncio.to_thread(read)
        return self._cluster_key

    async def high_water_mark(self, partition_id: int) -> int:
        """The partition's last committed transaction id (-1 for an empty log); PartitionNotReadyError (once
        ``client.requestTimeout`` is used up, as ClientTimeoutError) while the partition is not served."""
        self._check(partition_id)
        return await retry_rpc(
            lambda: self._hwm_attempt(partition_id),
            f"high_water_mark({partition_id})",
            self._config.request_timeout_ms,
        )

    async def _hwm_attempt(self, partition_id: int) -> int:
        endpoint, generation = self._target(partition_id)
        # rpc_high_water_mark raises PartitionNotReadyError for a partition that is not served.
        return await rpc_high_water_mark(
            self._rpc, endpoint, partition_id, generation, self._attempt_timeout_ms
        )

    async def read_range(self, partition_id: int, start: int, max_count: int) -> list[Record]:
        """Up to ``max_count`` committed records from ``start`` (fewer, or none, at the high-water mark)."""
        return await self._ranged(
            "read_range",
            partition_id,
            start,
            max_count,
            lambda endpoint, generation: rpc_read_range(
                self._rpc, endpoint, partition_id, generation, start, max_count, self._attempt_timeout_ms
            ),
        )

    async def read_run(self, partition_id: int, start: int, max_count: int) -> RecordRun:
        """Like :meth:`read_range`, but the records as one :class:`~waltz.protocol.record_run.RecordRun`, the
        bytes the storage node keeps, unpacked (and checksum-verified) only when the caller asks: the fast
        path for columnar readers, which unpack straight into columns (:meth:`RecordRun.columns`)."""

        async def rpc(endpoint: str, generation: int) -> RecordRun:
            count, run = await rpc_read_run(
                self._rpc, endpoint, partition_id, generation, start, max_count, self._attempt_timeout_ms
            )
            return RecordRun(start, count, run)

        return await self._ranged("read_run", partition_id, start, max_count, rpc)

    async def _ranged(
        self,
        what: str,
        partition_id: int,
        start: int,
        max_count: int,
        rpc: Callable[[str, int], Awaitable[T]],
    ) -> T:
        """``rpc(endpoint, generation)`` on the owner of the partition, retried within the request timeout."""
        self._check(partition_id)
        if start < 0 or max_count < 0:
            raise ClientError(f"bad range: start {start}, max_count {max_count}")

        async def attempt() -> T:
            endpoint, generation = self._target(partition_id)
            result = await rpc(endpoint, generation)
            empty = result.count == 0 if isinstance(result, RecordRun) else not result
            if empty and max_count > 0:
                # Nothing at ``start``: the end of the log, or a partition whose owner has not opened its
                # store (it answers every range as past its unknown high-water mark). Only the high-water
                # mark tells them apart; asking costs one round trip, only at the end of the log.
                await self._hwm_attempt(partition_id)
            return result

        return await retry_rpc(
            attempt, f"{what}({partition_id}, {start}, {max_count})", self._config.request_timeout_ms
        )

    async def read(
        self,
        partition_id: int,
        start: int = 0,
        end: int | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> AsyncIterator[Record]:
        """Every record from ``start`` to ``end`` inclusive (``end`` None: the high-water mark when the
        iteration starts), in id order, fetched ``batch_size`` at a time."""
        if batch_size < 1:
            raise ClientError(f"batch_size must be at least 1, got {batch_size}")
        if end is None:
            end = await self.high_water_mark(partition_id)
        position = start
        while position <= end:
            batch = await self.read_range(partition_id, position, min(batch_size, end - position + 1))
            if not batch:
                raise PartitionNotReadyError(
                    f"partition {partition_id}: no record at {position} although {end} was asked for "
                    "(past the high-water mark?)"
                )
            for record in batch:
                yield record
            position += len(batch)

    @property
    def _attempt_timeout_ms(self) -> int:
        return min(self._config.request_timeout_ms, RPC_ATTEMPT_TIMEOUT_MS)

    def _check(self, partition_id: int) -> None:
        if self._closed:
            raise ClientClosedError("the reader is closed")
        if not self._opened:
            raise ClientError("the reader is not open (use 'async with' or 'await reader.open()')")
        if not 0 <= partition_id < self.num_partitions:
            raise ClientError(f"partition {partition_id} outside 0..{self.num_partitions - 1}")

    def _target(self, partition_id: int) -> tuple[str, int]:
        target = self._discovery.endpoints.get(partition_id)
        if target is None:
            raise PartitionNotReadyError(f"partition {partition_id} has no server assigned yet")
        return target
