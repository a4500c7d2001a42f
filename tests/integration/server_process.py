"""Real Waltz server processes, and a whole cluster (ZooKeeper chroot, storage nodes, servers) for tests.

``ServerProcess`` writes a YAML config, starts ``python -m waltz.cli.main server run --config ...`` and waits
for the JSON line ``{"port", "http_port", "server_id"}`` the command prints once it serves. Its stderr goes to
``<base>/<name>.log``. Besides :meth:`kill` (SIGKILL) and :meth:`terminate` (SIGTERM) it can :meth:`pause`
(SIGSTOP) and :meth:`resume` (SIGCONT) the process, which is how the fencing test makes a server lose its
ZooKeeper session while it still believes it owns its partitions.

``Cluster`` builds a cluster in a ZooKeeper chroot: ``create_cluster`` with the storage processes' cluster
key, storage nodes registered with ``add_storage_node`` + ``assign_partitions`` and told their partitions
through the admin port (``set_assigned``), then servers. Tests use short timeouts (a 4000 ms ZooKeeper
session, storage retries capped at 500 ms) so failovers take seconds. :meth:`Cluster.stop` stops every
process it started, servers first; the ``cluster`` fixture in ``tests/integration/conftest.py`` calls it.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, Self

from kazoo.client import KazooClient

from tests.integration.storage_process import DEFAULT_KEY, StorageProcess
from tests.integration.waltz_process import READY_TIMEOUT_S, WaltzProcess, WaltzProcessError
from waltz.cluster import store_metadata as sm
from waltz.protocol.records import Record
from waltz.server.storage_client import AdminClient

TEST_ZK_SESSION_TIMEOUT_MS = 4000

TEST_SERVER_CONFIG: dict[str, Any] = {
    "zookeeper.sessionTimeout": TEST_ZK_SESSION_TIMEOUT_MS,
    "storage.initialRetryInterval": 50,
    "storage.maxRetryInterval": 500,
    "storage.rpcTimeout": 5000,
}
"""Server settings for tests: fast session expiry and fast reconnection to storage nodes."""


class ServerProcessError(WaltzProcessError):
    """The server process did not start, or died, in a way the test did not ask for."""


def free_port() -> int:
    """A currently free loopback port (for ports that cannot be 0, such as the server's HTTP port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess(WaltzProcess):
    """One Waltz server process on loopback; see the module docstring."""

    COMMAND = "server"
    ERROR = ServerProcessError

    def __init__(
        self,
        base: Path,
        *,
        zk_connect: str,
        cluster_root: str,
        name: str = "server",
        config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> None:
        values: dict[str, Any] = {
            "zookeeper.connectString": zk_connect,
            "cluster.root": cluster_root,
            "server.port": 0,
            "server.http.port": free_port(),
            **TEST_SERVER_CONFIG,
        }
        values.update(config or {})
        super().__init__(base, name, values, verbose=verbose)
        self.port = 0
        self.http_port = 0
        self.server_id = -1

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _config_for_start(self) -> dict[str, Any]:
        values = dict(self.config)
        if self.port:  # a restart keeps its ports
            values["server.port"] = self.port
        return values

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> Self:
        """Start and wait until it serves. The HTTP port was free when this object was made, but a process
        started since (a storage node on port 0) may have been given it: a first start refused for that port
        takes another free one, once."""
        try:
            return super().start(timeout_s)
        except ServerProcessError as e:
            if self.port or "(server.http.port): Address already in use" not in str(e):
                raise
        self.config["server.http.port"] = free_port()
        return super().start(timeout_s)

    def _on_ready(self, ready: dict[str, Any]) -> None:
        self.port, self.http_port, self.server_id = (
            int(ready["port"]),
            int(ready["http_port"]),
            int(ready["server_id"]),
        )

    def __repr__(self) -> str:
        return f"ServerProcess({self.name}, {self._state()}, port {self.port}, id {self.server_id})"


class Cluster:
    """A Waltz cluster of real processes in one ZooKeeper chroot (see the module docstring).

    Methods that start processes or talk to storage nodes are coroutines (they run blocking work in threads)
    so tests can call them while their clients keep appending on the same loop. :meth:`stop` is synchronous.
    """

    def __init__(
        self,
        base: Path,
        zk: KazooClient,
        zk_connect: str,
        *,
        num_partitions: int = 1,
        root: str = "/cluster",
        server_config: dict[str, Any] | None = None,
        storage_config: dict[str, Any] | None = None,
        verbose: bool = False,
        cluster_key: uuid.UUID = DEFAULT_KEY,
        feature_version: int | None = None,
    ) -> None:
        self.base = Path(base)
        self.zk = zk
        self.zk_connect = zk_connect
        self.num_partitions = num_partitions
        self.root = root
        self.cluster_key = cluster_key
        self.server_config = dict(server_config or {})
        self.storage_config = dict(storage_config or {})
        self.verbose = verbose
        self.storages: list[StorageProcess] = []
        self.faulty_storages: set[int] = set()
        """Indexes of the storage nodes to start on the failing file layer (see ``StorageProcess.faulty``)."""
        self.servers: list[ServerProcess] = []
        sm.create_cluster(
            zk, root, "test", num_partitions, cluster_key=self.cluster_key, feature_version=feature_version
        )

    # -- storage nodes ---------------------------------------------------------------------------------------

    @staticmethod
    def address(storage: StorageProcess) -> str:
        return f"127.0.0.1:{storage.port}"

    async def add_storage(self, partitions: list[int] | None = None) -> StorageProcess:
        """Start a storage node, register it in ZooKeeper and assign it ``partitions`` (default: all)."""
        parts = list(range(self.num_partitions)) if partitions is None else partitions
        sp = StorageProcess(
            self.base,
            cluster_key=self.cluster_key,
            num_partitions=self.num_partitions,
            config=self.storage_config,
            name=f"storage-{len(self.storages)}",
            verbose=self.verbose,
            faulty=len(self.storages) in self.faulty_storages,
        )
        self.storages.append(sp)
        await asyncio.to_thread(sp.start)
        async with await self.admin(sp) as admin:
            await admin.set_assigned(parts, True)
        addr = self.address(sp)
        await asyncio.to_thread(sm.add_storage_node, self.zk, self.root, addr, 0, sp.admin_port)
        if parts:
            await asyncio.to_thread(sm.assign_partitions, self.zk, self.root, addr, parts)
        return sp

    async def unassign_storage(self, sp: StorageProcess, partitions: list[int] | None = None) -> None:
        """Take partitions (default: all) away from a storage node in ZooKeeper: its servers drop it."""
        parts = list(range(self.num_partitions)) if partitions is None else partitions
        await asyncio.to_thread(sm.unassign_partitions, self.zk, self.root, self.address(sp), parts)

    async def admin(self, sp: StorageProcess) -> AdminClient:
        return await AdminClient.connect("127.0.0.1", sp.admin_port, self.cluster_key, self.num_partitions)

    async def max_transaction_id(self, sp: StorageProcess, partition: int = 0) -> int:
        async with await self.admin(sp) as admin:
            return await admin.max_transaction_id(partition)

    async def read_log(self, sp: StorageProcess, partition: int = 0, upto: int | None = None) -> list[Record]:
        """Every record a storage node holds for ``partition`` (up to ``upto`` if given), in id order."""
        out: list[Record] = []
        async with await self.admin(sp) as admin:
            last = await admin.max_transaction_id(partition) if upto is None else upto
            while len(out) <= last:
                batch = await admin.read_records(partition, len(out), min(1000, last - len(out) + 1))
                if not batch:
                    break
                out.extend(batch)
        return out

    def replace_directory(self, sp: StorageProcess, copy: Path) -> None:
        """Replace a stopped storage node's directory with ``copy`` (an older copy of it)."""
        if sp.is_running:
            raise RuntimeError("stop the storage node before replacing its directory")
        shutil.rmtree(sp.directory)
        shutil.copytree(copy, sp.directory)

    # -- servers ---------------------------------------------------------------------------------------------

    async def add_server(self, config: dict[str, Any] | None = None) -> ServerProcess:
        values = {**self.server_config, **(config or {})}
        proc = ServerProcess(
            self.base,
            zk_connect=self.zk_connect,
            cluster_root=self.root,
            name=f"server-{len(self.servers)}",
            config=values,
            verbose=self.verbose,
        )
        self.servers.append(proc)
        await asyncio.to_thread(proc.start)
        return proc

    def server_by_port(self, port: int) -> ServerProcess:
        for s in self.servers:
            if s.port == port:
                return s
        raise KeyError(port)

    async def start(self, storages: int = 3, servers: int = 1) -> Self:
        for _ in range(storages):
            await self.add_storage()
        for _ in range(servers):
            await self.add_server()
        return self

    def partition_metadata_generation(self, partition: int = 0) -> int:
        metadata, _ = sm.read_partition_metadata(self.zk, self.root, partition)
        return metadata.generation

    # -- teardown --------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process started, servers first; never raises for one that is already gone."""
        for proc in [*self.servers, *self.storages]:
            try:
                proc.stop()
            except Exception:  # keep stopping the others
                proc.kill()

    def logs(self) -> str:
        """Every process log (for failure reports)."""
        return "\n".join(
            f"===== {proc.name} =====\n{proc.log_text()[-20000:]}" for proc in [*self.servers, *self.storages]
        )


async def wait_until(condition: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    """Poll ``condition`` (a function, possibly async) until true; AssertionError after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)


async def settled_logs(
    cluster: Cluster, storages: list[StorageProcess], hwm: int, partition: int = 0, timeout_s: float = 30.0
) -> list[list[Record]]:
    """Wait until every storage node holds exactly ``0..hwm``, then return their records (one list each)."""

    async def caught_up() -> bool:
        ids = [await cluster.max_transaction_id(sp, partition) for sp in storages]
        return all(i == hwm for i in ids)

    try:
        await wait_until(caught_up, timeout_s, f"every replica to hold exactly 0..{hwm}", 0.2)
    except AssertionError:
        ids = [await cluster.max_transaction_id(sp, partition) for sp in storages]
        raise AssertionError(f"replicas did not settle at {hwm}: max ids {ids}") from None
    return [await cluster.read_log(sp, partition) for sp in storages]


def assert_identical(logs: list[list[Record]], hwm: int) -> None:
    """Every replica holds the same records ``0..hwm``, byte for byte, each passing its checksum."""
    first = logs[0]
    assert [r.transaction_id for r in first] == list(range(hwm + 1))
    for r in first:
        assert r.verify(), f"record {r.transaction_id} fails its checksum"
    for i, other in enumerate(logs[1:], 1):
        assert len(other) == len(first), f"replica {i} holds {len(other)} records, replica 0 {len(first)}"
        for a, b in zip(first, other, strict=True):
            assert a == b, f"replica {i} differs at {a.transaction_id}: {a!r} != {b!r}"
