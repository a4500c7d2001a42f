"""The "disks restored from snapshots" runbook (docs/operations.md), step by step, against a real ZooKeeper,
storage nodes and servers (issue 24, goal 7).

Every replica's disk goes back to a cold copy taken before the cluster committed more, while ZooKeeper keeps
its newer record: every replica is *restored*, the vote can never be decided, and nothing served the
partition again. ``waltz cluster accept-loss`` keeps the best copy up to a named transaction, shows what is
lost, and after ``--yes`` the partition is served again from the next id.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.ops_cli import cli_config, verify_lines, waltz
from tests.integration.server_process import assert_identical, settled_logs
from tests.integration.test_metadata_rebuild import _append
from tests.integration.test_security_probes import _zk_storage_config
from waltz.cluster import store_metadata as sm
from waltz.cluster.partition_metadata import UNRESOLVED

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(240)
def test_disks_restored_from_snapshots_runbook_accepts_the_loss_and_the_partition_serves_again(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()
    _zk_storage_config(cluster)

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        config = cli_config(cluster)
        assert await _append(cluster, 1, 0, b"kept", 30) == list(range(30))
        # Acknowledged means durable on a quorum (2 of 3), not on every replica: the third may still be
        # catching up (it joined the store session late, say), and a copy taken now would hold less there.
        # The runbook's snapshots are of a settled cluster: wait until every replica holds 0..29.
        assert_identical(await settled_logs(cluster, cluster.storages, 29), 29)
        # A cold copy of every node (the whole cluster stopped), then the cluster goes on (a new store
        # session) and commits 30..49.
        await asyncio.to_thread(cluster.stop)
        snapshots = [cluster.base / f"{sp.name}-snapshot" for sp in cluster.storages]
        for sp, snapshot in zip(cluster.storages, snapshots, strict=True):
            await asyncio.to_thread(shutil.copytree, sp.directory, snapshot)
        for proc in [*cluster.storages, *cluster.servers]:
            await asyncio.to_thread(proc.start)
        assert await _append(cluster, 3, 0, b"lost", 20) == list(range(30, 50))
        recorded, _ = sm.read_partition_metadata(cluster.zk, cluster.root, 0)
        accept = ("cluster", "accept-loss", "-c", config, "-p", "0")
        code, _, err = await waltz(*accept, "--keep-through", "29")
        assert code == 2
        assert "is live and owns partition 0: stop the servers first" in err

        # The disks come back from the copies. Runbook step 1: stop the servers first.
        for server in cluster.servers:
            await asyncio.to_thread(server.stop)
        for sp, snapshot in zip(cluster.storages, snapshots, strict=True):
            await asyncio.to_thread(sp.stop)
            cluster.replace_directory(sp, snapshot)
            await asyncio.to_thread(sp.start)

        # Step 2: verify says every replica is older than ZooKeeper's record, with each one's max id.
        code, lines = await verify_lines(config)
        assert code == 1
        text = "\n".join(lines)
        assert text.count("max transaction id 29, is older than ZooKeeper's record") == 3, text
        assert "every replica is older than ZooKeeper's record" in text
        assert "waltz cluster accept-loss" in text

        # recover-partition cannot help (every source is restored) and says which flag would override what.
        a, b = (cluster.address(sp) for sp in cluster.storages[:2])
        recover = ("storage", "recover-partition", "-c", config, "-p", "0", "--source", a, "--destination", b)
        code, _, err = await waltz(*recover)
        assert code == 2
        assert "--untrusted-source" in err
        code, _, err = await waltz(*recover, "--force")
        assert code == 2
        assert "--untrusted-source" in err
        assert "--shorten-destination" in err

        # Step 3: accept-loss refuses what no replica holds, shows the loss without --yes, writes nothing.
        code, _, err = await waltz(*accept, "--keep-through", "49")
        assert code == 2
        assert "no replica of partition 0 holds transaction 49" in err
        code, out, err = await waltz(*accept, "--keep-through", "29")
        assert code == 0, err
        assert f"ZooKeeper records session {recorded.session_id}; every replica is older" in out
        assert "Lost: everything above 29" in out
        assert "run again with --yes" in out
        assert sm.read_partition_metadata(cluster.zk, cluster.root, 0)[0] == recorded

        # Step 4: accept it.
        code, out, err = await waltz(*accept, "--keep-through", "29", "--yes")
        assert code == 0, err
        after, _ = sm.read_partition_metadata(cluster.zk, cluster.root, 0)
        assert after.session_id >= recorded.session_id
        assert {r.session_id for r in after.replicas.values()} == {after.session_id}
        assert {r.closing_high_water_mark for r in after.replicas.values()} == {UNRESOLVED}
        # Done once, it is not needed again: recovery can settle now.
        code, _, err = await waltz(*accept, "--keep-through", "29")
        assert code == 2
        assert "can recover without losing anything" in err

        # Step 5: start the servers: served again from 30, the kept transactions first, on every replica.
        for server in cluster.servers:
            await asyncio.to_thread(server.start)
        assert await _append(cluster, 2, 0, b"new", 5) == list(range(30, 35))
        logs = await settled_logs(cluster, cluster.storages, 34)
        assert_identical(logs, 34)
        assert [r.data for r in logs[0]] == [b"kept-%d" % i for i in range(30)] + [
            b"new-%d" % i for i in range(5)
        ]
        code, lines = await verify_lines(config)
        assert code == 0, lines

    asyncio.run(main())
