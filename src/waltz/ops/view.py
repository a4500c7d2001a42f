"""What every operator tool starts from: the cluster's ZooKeeper metadata, and connections to its nodes.

:class:`ClusterView` is a snapshot of ``<root>`` (read once with :func:`read_view`); the tools compare it
with what each storage node and server reports. Storage nodes are named by their data address
``host:port`` as ZooKeeper records it; their admin port comes from the connection metadata.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from ssl import SSLContext

from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.config import host_port
from waltz.errors import ConfigError
from waltz.server.storage_client import AdminClient, StorageClient

CONNECT_TIMEOUT_MS = 3_000
"""Time allowed to reach one node: the tools report an unreachable node instead of waiting on it."""


@dataclass(frozen=True)
class ClusterView:
    """One read of a cluster's metadata, plus the TLS context to reach its nodes with."""

    info: sm.ClusterInfo
    ssl: SSLContext | None = None

    @property
    def num_partitions(self) -> int:
        return self.info.params.num_partitions

    @property
    def storages(self) -> list[str]:
        """Every storage node ZooKeeper knows (registered in a group or holding replicas), sorted."""
        return sorted(set(self.info.groups.groups) | set(self.info.replicas.replicas))

    def replicas_of(self, partition: int) -> list[str]:
        """The storage nodes ZooKeeper assigns ``partition`` to, sorted."""
        return sorted(s for s, parts in self.info.replicas.replicas.items() if partition in parts)

    def assigned_to(self, storage: str) -> list[int]:
        return sorted(self.info.replicas.replicas.get(storage, ()))

    def metadata(self, partition: int) -> PartitionMetadata | None:
        return self.info.partitions.get(partition)

    def admin_address(self, storage: str) -> tuple[str, int]:
        port = self.info.connections.admin_ports.get(storage)
        if port is None:
            raise ConfigError(f"ZooKeeper has no admin port for storage node {storage}")
        host, _ = host_port(storage)
        return host, port

    def storage_for_admin(self, admin: str) -> str:
        """The storage node (data address) whose admin address is ``admin`` (``host:adminPort``)."""
        host, port = host_port(admin)
        for storage, admin_port in self.info.connections.admin_ports.items():
            if admin_port == port and host_port(storage)[0] == host:
                return storage
        raise ConfigError(f"no storage node in ZooKeeper has the admin address {admin}")

    def check_storage(self, storage: str) -> str:
        host, port = host_port(storage)
        name = f"{host}:{port}"
        if name not in self.storages:
            known = ", ".join(self.storages) or "none"
            raise ConfigError(f"{name} is not a storage node of this cluster (known: {known})")
        return name

    def check_partition(self, partition: int) -> int:
        if not 0 <= partition < self.num_partitions:
            raise ConfigError(
                f"partition {partition} out of range: the cluster has {self.num_partitions} partitions"
            )
        return partition

    @asynccontextmanager
    async def admin(self, storage: str) -> AsyncIterator[AdminClient]:
        """An admin connection to ``storage``, opened with the cluster key."""
        host, port = self.admin_address(storage)
        client = await AdminClient.connect(
            host,
            port,
            self.info.store.cluster_key,
            self.num_partitions,
            connect_timeout_ms=CONNECT_TIMEOUT_MS,
            ssl=self.ssl,
        )
        async with client:
            yield client

    @asynccontextmanager
    async def data(self, storage: str) -> AsyncIterator[StorageClient]:
        """A data-port connection to ``storage``, opened with the cluster key."""
        host, port = host_port(storage)
        client = await StorageClient.connect(
            host,
            port,
            self.info.store.cluster_key,
            self.num_partitions,
            connect_timeout_ms=CONNECT_TIMEOUT_MS,
            ssl=self.ssl,
        )
        async with client:
            yield client


def read_view(client: KazooClient, root: str, ssl: SSLContext | None = None) -> ClusterView:
    """Read the cluster at ``root`` (blocking: ZooKeeper)."""
    return ClusterView(sm.describe_cluster(client, root), ssl)
