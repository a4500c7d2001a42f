"""A small real cluster for the client integration tests, and the applications those tests run.

``ClientTestCluster`` (a context manager) creates a cluster in the test's ZooKeeper chroot, starts storage
nodes (:class:`~tests.integration.storage_process.StorageProcess`, assigned every partition) and Waltz server
processes (``python -m waltz.cli.main server run``) with a 4000 ms ZooKeeper session so a killed server's
partitions move within seconds. Leaving the ``with`` block stops every process, servers first; if the block
raised, the tail of every process log is printed.

The applications:

* :class:`CounterApp` keeps, per partition, every transaction it applied (id, data) in memory, and the
  counter value the data holds; :class:`Increment` reads that counter and appends ``counter + 1`` under one
  write lock, the textbook read-modify-write that optimistic locking must keep from losing updates;
* :class:`Tagged` appends a unique tag without locks (the network fault tests count the tags).

``RewritingDiscovery`` wraps the ZooKeeper discovery and replaces server endpoints (to put a TCP proxy
between a client and its server).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import sqlalchemy as sa
from kazoo.client import KazooClient

from tests.integration.server_process import TEST_ZK_SESSION_TIMEOUT_MS, ServerProcess
from tests.integration.storage_process import DEFAULT_KEY, StorageProcess
from waltz import (
    ClientConfig,
    PartitionLocalLock,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
)
from waltz.client.api import ClientCallbacks
from waltz.client.discovery import Endpoints, ZkDiscovery
from waltz.client.serializer import JsonSerializer
from waltz.client.sql import GuardedConnection, SqlClientCallbacks
from waltz.cluster import store_metadata as sm
from waltz.server.storage_client import AdminClient

JSON = JsonSerializer()
ROOT = "/waltz-client-test"


class ClientTestCluster:
    """ZooKeeper chroot + storage nodes + servers (see the module docstring)."""

    def __init__(
        self,
        base: Path,
        zk: KazooClient,
        zk_connect: str,
        *,
        num_partitions: int = 1,
        storages: int = 1,
        servers: int = 1,
        feature_version: int | None = None,
    ) -> None:
        self.base = base
        self.feature_version = feature_version
        self.zk = zk
        self.zk_connect = zk_connect
        self.num_partitions = num_partitions
        self.root = ROOT
        self.storages: list[StorageProcess] = []
        self.servers: list[ServerProcess] = []
        self._num_storages = storages
        self._num_servers = servers

    async def __aenter__(self) -> Self:
        try:
            await asyncio.to_thread(
                sm.create_cluster,
                self.zk,
                self.root,
                "client-test",
                self.num_partitions,
                cluster_key=DEFAULT_KEY,
                feature_version=self.feature_version,
            )
            for _ in range(self._num_storages):
                await self._add_storage()
            for _ in range(self._num_servers):
                await self.add_server()
        except BaseException:
            self.stop(failed=True)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(failed=exc is not None)

    async def _add_storage(self) -> None:
        parts = list(range(self.num_partitions))
        sp = StorageProcess(
            self.base, num_partitions=self.num_partitions, name=f"storage-{len(self.storages)}"
        )
        self.storages.append(sp)
        await asyncio.to_thread(sp.start)
        admin = await AdminClient.connect("127.0.0.1", sp.admin_port, DEFAULT_KEY, self.num_partitions)
        async with admin:
            await admin.set_assigned(parts, True)
        address = f"127.0.0.1:{sp.port}"
        await asyncio.to_thread(sm.add_storage_node, self.zk, self.root, address, 0, sp.admin_port)
        await asyncio.to_thread(sm.assign_partitions, self.zk, self.root, address, parts)

    async def add_server(self) -> ServerProcess:
        # ServerProcess brings the test settings: a 4000 ms ZooKeeper session, fast storage retries.
        server = ServerProcess(
            self.base, zk_connect=self.zk_connect, cluster_root=self.root, name=f"server-{len(self.servers)}"
        )
        self.servers.append(server)
        await asyncio.to_thread(server.start)
        return server

    def server_at(self, endpoint: str) -> ServerProcess:
        for server in self.servers:
            if server.address == endpoint:
                return server
        raise KeyError(endpoint)

    def client_config(self, **changes: Any) -> ClientConfig:
        """A client config for this cluster; generous mount/submit timeouts ride out failovers."""
        values: dict[str, Any] = {
            "zookeeper_connect_string": self.zk_connect,
            "zookeeper_session_timeout_ms": TEST_ZK_SESSION_TIMEOUT_MS,
            "cluster_root": self.root,
            "mount_timeout_ms": 60000,
            "submit_timeout_ms": 60000,
            "long_wait_threshold_ms": 1000,
            "num_consumer_threads": 2,
        }
        values.update(changes)
        return ClientConfig(**values)

    def stop(self, *, failed: bool = False) -> None:
        for proc in [*self.servers, *self.storages]:
            with contextlib.suppress(Exception):
                proc.stop()
        if failed:
            for server in self.servers:
                print(f"===== {server.name} =====\n{server.log_text()[-8000:]}")
            for storage in self.storages:
                print(f"===== {storage.name} =====\n{storage.log_text()[-4000:]}")


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------- applications


class CounterApp(ClientCallbacks):
    """In-memory application state per partition: every applied (transaction id, data), in order."""

    def __init__(self, num_partitions: int, start_hwm: int = -1) -> None:
        self.lock = threading.Lock()
        self.applied: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(num_partitions)}
        self.hwm = dict.fromkeys(range(num_partitions), start_hwm)
        self.errors: list[str] = []

    def client_high_water_mark(self, partition_id: int) -> int:
        with self.lock:
            return self.hwm[partition_id]

    def apply_transaction(self, transaction: Transaction) -> None:
        self._apply(transaction, transaction.get_transaction_data())

    def _apply(self, transaction: Transaction, data: bytes) -> None:
        with self.lock:
            p = transaction.partition_id
            if transaction.transaction_id != self.hwm[p] + 1:
                self.errors.append(f"p{p}: got {transaction.transaction_id} after {self.hwm[p]}")
            self.applied[p].append((transaction.transaction_id, data))
            self.hwm[p] = transaction.transaction_id

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        with self.lock:
            self.errors.append(f"p{partition_id} txn {transaction_id}: {exception!r}")

    def counter(self, partition_id: int) -> int:
        """The counter value of the last applied transaction of the partition (0 before any)."""
        with self.lock:
            rows = self.applied[partition_id]
            return int(rows[-1][1]) if rows else 0

    def data(self, partition_id: int) -> list[bytes]:
        with self.lock:
            return [d for _, d in self.applied[partition_id]]


class AsyncCounterApp(CounterApp):
    """:class:`CounterApp` for ``client.callbackMode: inline``: ``apply_transaction`` is a coroutine (a
    blocking data fetch is refused on the event loop)."""

    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        self._apply(transaction, await transaction.fetch_transaction_data())


CALLBACK_MODES = ("threads", "inline")
"""``client.callbackMode`` values the key integration tests run in."""


def counter_app(num_partitions: int, mode: str) -> CounterApp:
    """The counter application that suits ``client.callbackMode`` ``mode``."""
    return AsyncCounterApp(num_partitions) if mode == "inline" else CounterApp(num_partitions)


class Outcome(TransactionContext):
    """Records how a context ended."""

    def __init__(self) -> None:
        super().__init__()
        self.completed: bool | None = None
        self.exception: BaseException | None = None
        self.lock_failures = 0
        self.executions = 0
        self.ended = threading.Event()

    def on_completion(self, result: bool) -> None:
        self.completed = result
        self.ended.set()

    def on_exception(self, exception: BaseException) -> None:
        self.exception = exception
        self.ended.set()

    def on_lock_failure(self) -> None:
        self.lock_failures += 1


COUNTER_LOCK = "counter"


class Increment(Outcome):
    """``counter + 1`` for the partition's counter, as this client's application sees it, under a write
    lock on the counter: a stale read fails the append, and the retry reads again."""

    def __init__(self, app: CounterApp, partition: int) -> None:
        super().__init__()
        self.app = app
        self.partition = partition

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        self.executions += 1
        builder.set_transaction_data(str(self.app.counter(self.partition) + 1).encode())
        builder.set_write_locks([PartitionLocalLock(COUNTER_LOCK, self.partition)])
        return True


class Tagged(Outcome):
    """Appends ``tag`` (bytes) to a partition, without locks."""

    def __init__(self, tag: bytes, partition: int = 0) -> None:
        super().__init__()
        self.tag = tag
        self.partition = partition

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        self.executions += 1
        builder.set_transaction_data(self.tag)
        return True


# -------------------------------------------------------------------------------------------------- discovery


class RewritingDiscovery(ZkDiscovery):
    """ZooKeeper discovery whose endpoints are rewritten by ``rewrite`` (e.g. towards a proxy)."""

    def __init__(self, config: ClientConfig, rewrite: Callable[[str], str]) -> None:
        super().__init__(config)
        self._rewrite = rewrite

    def _apply(self, endpoints: Endpoints) -> Endpoints:
        return {p: (self._rewrite(e), g) for p, (e, g) in endpoints.items()}

    @property
    def endpoints(self) -> Endpoints:
        return self._apply(super().endpoints)

    async def updates(self) -> AsyncIterator[Endpoints]:
        async for endpoints in super().updates():
            yield self._apply(endpoints)


# ------------------------------------------------------------------------- a SQL application in a process

SQL_METADATA = sa.MetaData()
SQL_ACCOUNTS = sa.Table(
    "accounts",
    SQL_METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.BigInteger, nullable=False),
)
SQL_APPLIED = sa.Table(  # One row per applied transaction: the primary key refuses a second application.
    "applied",
    SQL_METADATA,
    sa.Column("partition_id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("transaction_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("instance", sa.Integer, nullable=False),
)


class SqlBank(SqlClientCallbacks):
    """Deposits ``{"account": id, "amount": n}`` into ``accounts``, recording each application."""

    def __init__(self, engine: sa.Engine, instance: int) -> None:
        super().__init__(engine)
        self.instance = instance

    def apply(self, transaction: Transaction, connection: GuardedConnection) -> None:
        body = transaction.get_transaction_data(JSON)
        connection.execute(
            sa.insert(SQL_APPLIED).values(
                partition_id=transaction.partition_id,
                transaction_id=transaction.transaction_id,
                instance=self.instance,
            )
        )
        row = SQL_ACCOUNTS.c.id == body["account"]
        credit = sa.update(SQL_ACCOUNTS).where(row).values(balance=SQL_ACCOUNTS.c.balance + body["amount"])
        if connection.execute(credit).rowcount == 0:
            connection.execute(sa.insert(SQL_ACCOUNTS).values(id=body["account"], balance=body["amount"]))


class SqlDeposit(Outcome):
    def __init__(self, account: int, amount: int) -> None:
        super().__init__()
        self.account = account
        self.amount = amount

    def partition_id(self, num_partitions: int) -> int:
        return self.account % num_partitions

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data({"account": self.account, "amount": self.amount}, JSON)
        return True


def create_sql_tables(pg_url: str) -> None:
    """Create the application's tables and the high-water-mark table once, before the instances start
    (concurrent CREATE TABLEs of several processes would race)."""
    engine = sa.create_engine(pg_url)
    try:
        SQL_METADATA.create_all(engine)
        SqlBank(engine, -1)  # Creates the high-water-mark table.
    finally:
        engine.dispose()


def run_sql_app(config: ClientConfig, pg_url: str, instance: int, deposits: int, accounts: int) -> None:
    """One application process: ``deposits`` deposits of ``instance + 1`` into accounts
    ``0..accounts-1``, then wait until every one of them is applied (by any instance)."""
    engine = sa.create_engine(pg_url, pool_size=4)
    bank = SqlBank(engine, instance)
    client = WaltzClient(bank, config)
    try:
        contexts = [SqlDeposit(i % accounts, instance + 1) for i in range(deposits)]
        for context in contexts:
            client.submit(context)
        client.flush_transactions(120)
        failed = [c for c in contexts if c.completed is not True]
        if failed:
            raise SystemExit(
                f"instance {instance}: {len(failed)} deposits did not complete: {failed[0].exception!r}"
            )
    finally:
        client.close()
        engine.dispose()
