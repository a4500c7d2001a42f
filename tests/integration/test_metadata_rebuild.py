"""The "ZooKeeper lost" runbook (docs/operations.md), step by step, against a real ZooKeeper, storage nodes
and servers (issue 24, goal 6): the cluster root is deleted under a cluster holding data, ``waltz cluster
rebuild-metadata`` rebuilds it from the storage nodes, and every transaction is served again.

Before this tool, recreating the metadata by hand (``cluster create`` with the old key, nodes re-added)
left every partition with no recorded replica: the first server resolved its high-water mark to -1 and
truncated every replica to empty.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.ops_cli import admin, cli_config, waltz
from tests.integration.raw_client import RawClient
from tests.integration.server_process import Cluster, assert_identical, settled_logs
from tests.integration.test_security_probes import _zk_storage_config
from waltz.cluster import store_metadata as sm
from waltz.cluster.membership import ClusterWatcher
from waltz.cluster.partition_metadata import UNRESOLVED

pytestmark = [pytest.mark.integration]

PARTITIONS = 2


async def _append(cluster: Cluster, client_id: int, partition: int, tag: bytes, n: int) -> list[int]:
    async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
        client = await RawClient(watcher, client_id, partition).start()
        try:
            ids = [await asyncio.wait_for(client.append_and_wait(tag + b"-%d" % i), 30) for i in range(n)]
            assert client.violations == []
            return ids
        finally:
            await client.aclose()


@pytest.mark.timeout(240)
def test_zookeeper_lost_runbook_rebuilds_the_metadata_and_every_transaction_is_served_again(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(num_partitions=PARTITIONS)
    _zk_storage_config(cluster)  # Nodes that check session ids against ZooKeeper, as `waltz local` runs them.

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        config = cli_config(cluster)
        for p in range(PARTITIONS):
            assert await _append(cluster, 1, p, b"before", 30) == list(range(30))
        old_generation = {
            p: (await cluster.read_log(cluster.storages[0], p))[-1].req_id.generation for p in (0, 1)
        }
        # Step 1 of the runbook: stop the servers. Then ZooKeeper's data goes.
        for server in cluster.servers:
            await asyncio.to_thread(server.stop)
        await asyncio.to_thread(cluster.zk.delete, cluster.root, recursive=True)

        storage_args = [a for sp in cluster.storages for a in ("--storage", admin(sp))]
        rebuild = ("cluster", "rebuild-metadata", "-c", config, "--name", "test", *storage_args)

        # Bad input: an address where no storage node answers is named, and nothing is written.
        code, _, err = await waltz(*rebuild, "--storage", "127.0.0.1:1", "--yes")
        assert code != 0
        assert "127.0.0.1:1" in err
        assert cluster.zk.exists(cluster.root) is None

        # Step 2: the plan, without --yes: it names every replica and writes nothing.
        code, out, err = await waltz(*rebuild)
        assert code == 0, err
        assert f"key {cluster.cluster_key}" in out
        for sp in cluster.storages:
            assert f"storage node 127.0.0.1:{sp.port}" in out
        assert "recovery will resolve the high-water mark 29" in out
        assert "run again with --yes" in out
        assert cluster.zk.exists(cluster.root) is None

        # Step 3: write it.
        code, out, err = await waltz(*rebuild, "--yes")
        assert code == 0, err
        store = sm.read_store_params(cluster.zk, cluster.root)
        assert (store.cluster_key, store.num_partitions) == (cluster.cluster_key, PARTITIONS)
        replicas = sm.read_replica_assignments(cluster.zk, cluster.root).replicas
        assert {s: list(p) for s, p in replicas.items()} == {
            cluster.address(sp): list(range(PARTITIONS)) for sp in cluster.storages
        }
        for p in range(PARTITIONS):
            meta, _ = sm.read_partition_metadata(cluster.zk, cluster.root, p)
            assert set(meta.replicas) == {cluster.address(sp) for sp in cluster.storages}
            assert all(r.closing_high_water_mark == UNRESOLVED for r in meta.replicas.values())
            assert meta.session_id >= 0
        # A root that exists is not overwritten unless told to.
        code, _, err = await waltz(*rebuild, "--yes")
        assert code != 0
        assert "exists" in err
        assert "--replace" in err

        # Step 4: start the servers. Every transaction is still there and new ones follow them, at a
        # generation above every one stored.
        for server in cluster.servers:
            await asyncio.to_thread(server.start)
        for p in range(PARTITIONS):
            assert await _append(cluster, 2, p, b"after", 5) == list(range(30, 35))
            logs = await settled_logs(cluster, cluster.storages, 34, p)
            assert_identical(logs, 34)
            assert [r.data for r in logs[0]] == [b"before-%d" % i for i in range(30)] + [
                b"after-%d" % i for i in range(5)
            ]
            assert all(r.req_id.generation > old_generation[p] for r in logs[0][30:])
        code, out, _ = await waltz("cluster", "verify", "-c", config, "--timeout", "5")
        assert code == 0, out
        # Replacing a root while servers are registered under it is refused.
        code, _, err = await waltz(*rebuild, "--yes", "--replace")
        assert code != 0
        assert "stop every server" in err
        assert await _append(cluster, 3, 0, b"still", 1) == [35]

    asyncio.run(main())
