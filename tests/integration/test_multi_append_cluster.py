"""Many partitions appending through one server and three real storage nodes: below feature version 3 every
append is its own storage request; once the cluster's feature version is raised to 3 the server (following
it in ZooKeeper, no restart) sends the appends of one pass for one node as a MultiAppendRequest, and every
acknowledged append is on every replica at its id, with its data."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from tests.integration.server_process import Cluster, assert_identical, free_port, settled_logs, wait_until
from tests.integration.storage_process import StorageProcess
from waltz.cluster import features as ft
from waltz.cluster.membership import ClusterWatcher
from waltz.protocol.storage_multi import MULTI_APPEND_FEATURE_VERSION

pytestmark = [pytest.mark.integration]

PARTITIONS = 16
APPENDS_PER_PARTITION = 60


def _multi_requests(sp: StorageProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{sp.http_port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith('waltz_storage_requests_total{type="MultiAppendRequest"}'):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sp.name} exports no MultiAppendRequest count")


async def _multi_counts(cluster: Cluster) -> list[float]:
    return [await asyncio.to_thread(_multi_requests, sp) for sp in cluster.storages]


async def _append_everywhere(clients: list[RawClient], tag: str) -> None:
    """Every client appends to its partition, all at once (a few in flight per partition)."""

    async def one(client: RawClient) -> None:
        futures = [
            await client.append(f"{tag}:{client.partition}:{i}".encode())
            for i in range(APPENDS_PER_PARTITION)
        ]
        await asyncio.gather(*futures)

    await asyncio.gather(*(one(c) for c in clients))


async def _check_replicas(cluster: Cluster, clients: list[RawClient]) -> None:
    for client in clients:
        logs = await settled_logs(cluster, cluster.storages, client.hwm, client.partition)
        assert_identical(logs, client.hwm)
        by_id = {r.transaction_id: r for r in logs[0]}
        for rid, txn in client.acked.items():
            assert by_id[txn].req_id == rid
            assert by_id[txn].data == client.sent_data[rid]


@pytest.mark.timeout(240)
def test_many_partitions_append_through_multi_requests_once_the_feature_version_allows(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(num_partitions=PARTITIONS, feature_version=1)

    async def main() -> None:
        for _ in range(3):
            cluster.storage_config["storage.http.port"] = free_port()
            await cluster.add_storage()
        server = await cluster.add_server()
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            clients = [await RawClient(watcher, 1 + p, p, max_in_flight=8).start() for p in range(PARTITIONS)]
            try:
                await _append_everywhere(clients, "before")
                assert await _multi_counts(cluster) == [0, 0, 0]  # feature version 1: one request each

                await asyncio.to_thread(
                    ft.write_feature_version, cluster.zk, cluster.root, MULTI_APPEND_FEATURE_VERSION, -1
                )
                await wait_until(
                    lambda: "multi-partition storage appends on" in server.log_text(),
                    30,
                    "the server to follow the feature version",
                )
                await _append_everywhere(clients, "after")
                counts = await _multi_counts(cluster)
                assert all(n > 0 for n in counts), counts
                assert all(c.violations == [] for c in clients)
                assert all(len(c.acked) == 2 * APPENDS_PER_PARTITION for c in clients)
                await _check_replicas(cluster, clients)
            finally:
                for c in clients:
                    await c.aclose()

    asyncio.run(main())
