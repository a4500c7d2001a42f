"""The repair and verification tools on real processes: ``waltz storage recover-partition`` brings back a
partition whose replicas were wiped, ``remove-partition -d`` refuses to drop the last good copies, and
``waltz cluster verify``, ``check-connectivity``, ``waltz storage sync-partitions`` and ``validate`` report
what they find (one line per problem, exit status 1)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.ops_cli import (
    add_partition,
    cli_config,
    recover_partition,
    remove_partition_data,
    served,
    verify_lines,
    waltz,
)
from tests.integration.server_process import Cluster, assert_identical, settled_logs, wait_until
from tests.integration.storage_process import StorageProcess
from waltz.cluster import store_metadata as sm
from waltz.ops import checks
from waltz.ops.view import read_view

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(150)
def test_recover_partition_brings_back_two_wiped_replicas(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        config = cli_config(cluster)
        a, b, c = cluster.storages
        first = await served(cluster, 1, 300)
        assert first.hwm == 299
        code, lines = await verify_lines(config)
        assert (code, lines) == (0, ["OK: every partition served, replicated and healthy"])

        # Wiping one replica leaves two good copies: allowed. A second would leave one of three: refused.
        assert (await remove_partition_data(config, b))[0] == 0
        code, _, err = await remove_partition_data(config, c)
        assert code == 1
        assert "leaves 1 good copy (127.0.0.1:" in err
        assert "fewer than the quorum of 2" in err
        assert await cluster.max_transaction_id(c) == 299  # nothing was deleted
        assert (await remove_partition_data(config, c, force=True))[0] == 0
        await add_partition(config, b, c)

        # The partition cannot be served: one replica can vote, two lost their data. verify says so.
        async def stuck() -> bool:
            code, lines = await verify_lines(config)
            text = "\n".join(lines)
            return (
                code == 1
                and text.count("lost its data") == 2
                and "reports it unhealthy" in text
                and f"the replica on {Cluster.address(b)} lost its data" in text
            )

        await wait_until(
            stuck, 30, "verify to report the two wiped replicas and the unhealthy partition", 0.5
        )

        code, out, err = await recover_partition(config, a, b, "--batch-size", "64")
        assert code == 0, err
        assert "copied 300 records" in out
        assert "holds 0..299" in out
        assert "as voting" in out
        assert "300/300" in err  # the progress line

        # The server's waiting recovery sees the copy: the partition is served again, and the third replica
        # is caught up by the server itself.
        second = await served(cluster, 2, 100)
        assert second.hwm == 399
        logs = await settled_logs(cluster, cluster.storages, 399)
        assert_identical(logs, 399)
        code, lines = await verify_lines(config)
        assert code == 0, lines

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_verify_reports_a_stopped_storage_node_and_check_connectivity_sees_it(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        config = cli_config(cluster)
        await served(cluster, 1, 20)
        code, out, _ = await waltz("cluster", "check-connectivity", "-c", config, "--timeout", "5")
        assert code == 0
        assert out.count(": reachable") == 3

        victim = cluster.storages[2]
        victim.kill()
        code, lines = await verify_lines(config)
        assert code == 1
        assert f"storage {Cluster.address(victim)}: unreachable" in "\n".join(lines)
        assert any(f"cannot reach storage {Cluster.address(victim)}" in line for line in lines)
        # Two of three replicas still make a quorum.
        assert not any("no quorum" in line for line in lines)
        code, out, _ = await waltz("cluster", "check-connectivity", "-c", config, "--timeout", "5")
        assert code == 1
        assert f"{Cluster.address(victim)}: UNREACHABLE" in out
        code, out, _ = await waltz("storage", "validate", "-c", config, "--timeout", "5")
        assert code == 1
        assert out.count(": ok") == 4
        assert out.count("FAILED") == 2

        # The library under the commands, called directly.
        view = await asyncio.to_thread(read_view, cluster.zk, cluster.root)
        (server,) = await checks.check_connectivity(view, 5.0)
        assert server.report is not None
        assert server.report.storage_connectivity == {
            Cluster.address(sp): sp is not victim for sp in cluster.storages
        }
        problems = await checks.verify(view, [0], 5.0)
        assert any(
            p.partition is None and p.text.startswith(f"storage {Cluster.address(victim)}: unreachable")
            for p in problems
        )
        ports = await checks.validate_storages(view, 5.0)
        assert sorted((p.storage, p.port) for p in ports if p.error) == [
            (Cluster.address(victim), "admin"),
            (Cluster.address(victim), "data"),
        ]

        cluster.storages[1].kill()
        code, lines = await verify_lines(config, "-p", "0")
        assert code == 1
        assert "partition 0: no quorum: 1 of 3 replicas reachable and online" in "\n".join(lines)

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_sync_partitions_makes_storage_nodes_hold_what_zookeeper_assigns(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(num_partitions=4)

    async def main() -> None:
        await cluster.start(storages=2, servers=0)
        config = cli_config(cluster)
        a, b = cluster.storages
        # ZooKeeper and the nodes disagree: a lost partition 3, b holds partition 1 that ZooKeeper moved away.
        async with await cluster.admin(a) as adm:
            await adm.set_assigned([3], False)
        await asyncio.to_thread(sm.unassign_partitions, cluster.zk, cluster.root, Cluster.address(b), [1])
        code, out, _ = await waltz("storage", "sync-partitions", "-c", config, "--dry-run")
        assert code == 0
        assert f"{Cluster.address(a)}: would assign 3" in out
        assert f"{Cluster.address(b)}: would unassign 1 (files kept)" in out
        async with await cluster.admin(a) as adm:
            assert sorted(s.partition_id for s in await adm.partition_statuses()) == [0, 1, 2]
        code, out, _ = await waltz("storage", "sync-partitions", "-c", config)
        assert code == 0
        for sp, wanted in ((a, [0, 1, 2, 3]), (b, [0, 2, 3])):
            async with await cluster.admin(sp) as adm:
                assert sorted(s.partition_id for s in await adm.partition_statuses()) == wanted
        code, out, _ = await waltz("storage", "sync-partitions", "-c", config)
        assert (code, out.strip()) == (
            0,
            "every storage node holds exactly the partitions ZooKeeper assigns it",
        )

    asyncio.run(main())


@pytest.mark.timeout(150)
def test_recover_partition_refuses_a_damaged_source_and_repairs_a_damaged_destination(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        config = cli_config(cluster)
        a, b, c = cluster.storages
        first = await served(cluster, 1, 50)
        assert first.hwm == 49

        async def all_hold_everything() -> bool:
            return [await cluster.max_transaction_id(sp) for sp in (a, b, c)] == [49, 49, 49]

        # Acknowledged means on a quorum: a replica that joined late catches up a moment after the acks, and
        # the good source below must hold every record before the server goes.
        await wait_until(all_hold_everything, 30, "every replica to hold 0..49")
        # No server: its recovery would repair the damaged replica before the tools look at it.
        await asyncio.to_thread(cluster.servers[0].terminate)
        # What a power cut that dropped the partition directory's entry leaves: the node marks it damaged.
        await asyncio.to_thread(b.terminate)
        shutil.rmtree(b.directory / "0")
        await asyncio.to_thread(b.start)
        assert "partition 0: this replica is damaged" in b.log_text()

        def recover(source: StorageProcess, destination: StorageProcess, *extra: str) -> list[str]:
            return [
                "storage",
                "recover-partition",
                "-c",
                config,
                "-p",
                "0",
                "--source",
                Cluster.address(source),
                "--destination",
                Cluster.address(destination),
                *extra,
            ]

        for extra in ((), ("--untrusted-source",)):
            code, _, err = await waltz(*recover(b, c, *extra))
            assert code == 2, err  # a refused request, as every ConfigError
            assert f"source {Cluster.address(b)} holds a damaged replica" in err
        assert await cluster.max_transaction_id(c) == 49  # nothing was changed
        # A damaged destination is what the tool is for.
        code, out, err = await waltz(*recover(a, b))
        assert code == 0, err
        assert "holds 0..49" in out
        async with await cluster.admin(b) as admin:
            assert not (await admin.last_session_info(0)).damaged

    asyncio.run(main())
