"""``waltz cluster fix-generation`` against a real ZooKeeper, storage nodes and server (issue 15, item 4): a
bogus generation written into a partition's metadata leaves it unserved and reported; the tool shows the
change, refuses unsafe ones, writes with ``--yes``, and the partition is served again with nothing lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import waltz as waltz_package
from tests.integration.conftest import ClusterFactory
from tests.integration.ops_cli import cli_config, waltz
from tests.integration.raw_client import RawClient
from tests.integration.server_process import wait_until
from tests.integration.test_security_probes import _zk_storage_config
from waltz.cluster import store_metadata as sm
from waltz.cluster.membership import ClusterWatcher
from waltz.cluster.partition_metadata import PartitionMetadata

pytestmark = [pytest.mark.integration]

BOGUS = 1002


def _waltz_process(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it (its log lines go to its own stderr), on this source tree."""
    env = {**os.environ, "PYTHONPATH": str(Path(waltz_package.__file__).parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def _health(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:  # 503 while unhealthy, with the same body
        return dict(json.loads(e.read()))


@pytest.mark.timeout(120)
def test_a_bogus_generation_is_repaired_by_fix_generation_and_nothing_committed_is_lost(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(server_config={"storage.metadataConflictReport": 1000})
    _zk_storage_config(cluster)

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        config = cli_config(cluster)
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                before = [await client.append_and_wait(b"before-%d" % i) for i in range(20)]
                assert before == list(range(20))
                # Someone writes generation 1002 into the metadata (keeping the rest of it); the next store
                # session (a server restart here) meets it.
                metadata, version = sm.read_partition_metadata(cluster.zk, cluster.root, 0)
                forged = PartitionMetadata(BOGUS, metadata.session_id, metadata.replicas)
                sm.write_partition_metadata(cluster.zk, cluster.root, 0, forged, version)
                server = cluster.servers[0]
                await asyncio.to_thread(server.restart)

                async def reported() -> bool:
                    health = await asyncio.to_thread(_health, server.http_port)
                    return "0" in health.get("metadataConflicts", {})

                await wait_until(reported, 30, "the server to report the bogus generation")
                assigned = sm.read_partition_assignment(cluster.zk, cluster.root)[0].generations()[0]
                assert assigned < BOGUS

                code, out, _ = await waltz("cluster", "verify", "-c", config, "--timeout", "5")
                assert code == 1
                assert f"its metadata is at generation {BOGUS}, above the assignment's {assigned}" in out
                # Without --yes: shows the change, writes nothing.
                code, out, err = await waltz("cluster", "fix-generation", "-c", config, "-p", "0")
                assert code == 0, err
                assert f"change: generation {BOGUS} -> {assigned}" in out
                assert "run again with --yes" in out
                assert sm.read_partition_metadata(cluster.zk, cluster.root, 0)[0].generation == BOGUS
                # Below the generation that was really used: refused.
                code, out, err = await waltz(
                    "cluster", "fix-generation", "-c", config, "-p", "0", "--to", "0", "--yes"
                )
                assert code == 2
                assert "refusing to set partition 0's generation to 0" in err
                assert sm.read_partition_metadata(cluster.zk, cluster.root, 0)[0].generation == BOGUS

                done = await asyncio.to_thread(
                    _waltz_process, "cluster", "fix-generation", "-c", config, "-p", "0", "--yes"
                )
                assert done.returncode == 0, done.stderr
                assert f"written: partition 0 is at generation {assigned}" in done.stdout
                info = [line for line in done.stderr.splitlines() if " INFO " in line]
                assert len(info) == 1, done.stderr
                assert f"partition 0: metadata generation {BOGUS} -> {assigned}" in info[0]
                fixed = sm.read_partition_metadata(cluster.zk, cluster.root, 0)[0]
                assert fixed.generation <= assigned
                assert fixed.session_id >= metadata.session_id

                # Served again: new transactions commit after the old ones, every old one still there.
                after = [
                    await asyncio.wait_for(client.append_and_wait(b"after-%d" % i), 30) for i in range(5)
                ]
                assert after == list(range(20, 25))
                assert client.violations == []
            finally:
                await client.aclose()
        assert "0" not in (await asyncio.to_thread(_health, server.http_port)).get("metadataConflicts", {})
        assert "repaired; serving again" in server.log_text()
        _, out, _ = await waltz("cluster", "verify", "-c", config, "--timeout", "5")
        assert "above the assignment's" not in out
        for sp in cluster.storages:
            log = await cluster.read_log(sp, 0, 24)
            assert [r.data for r in log] == [b"before-%d" % i for i in range(20)] + [
                b"after-%d" % i for i in range(5)
            ]

    asyncio.run(main())
