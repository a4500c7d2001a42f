"""The runbook "A storage node lost power" (docs/operations.md), followed step by step on real processes: a
real ZooKeeper, three storage nodes and a server. A stopped node's partition directory is wiped, as a power
cut that dropped its directory entry leaves it; the node reports the damaged replica (ERROR line, /health,
``waltz cluster verify``), the replica does not vote (with only one other replica up the partition stays
unserved instead of settling on what the wiped replica would have counted), and once a quorum of good
replicas votes again the server's recovery repairs it: INFO line, healthy, every transaction served."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.ops_cli import cli_config, served, verify_lines
from tests.integration.server_process import Cluster, assert_identical, settled_logs, wait_until
from waltz.local.probe import http_get

pytestmark = [pytest.mark.integration]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
def test_a_storage_node_that_lost_power_is_reported_kept_out_of_the_vote_and_repaired(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        config = cli_config(cluster)
        a, b, c = cluster.storages
        first = await served(cluster, 1, 300)
        assert first.hwm == 299
        await settled_logs(cluster, cluster.storages, 299)

        # The power cut: node b goes down, and its partition directory with it. Node c is down too, so only a
        # and the wiped b can answer: b must not help decide anything.
        await asyncio.to_thread(b.kill)
        await asyncio.to_thread(c.terminate)
        shutil.rmtree(b.directory / "0")
        b.config["storage.http.port"] = _free_port()
        await asyncio.to_thread(b.restart)

        # Step 1 of the runbook: what the operator sees.
        assert "partition 0: this replica is damaged: its directory" in b.log_text()
        status, body = await asyncio.to_thread(http_get, b.http_port, "/health")
        assert status == 503
        assert json.loads(body)["partitions"]["0"].startswith("replica damaged")

        async def reported() -> bool:
            code, lines = await verify_lines(config)
            text = "\n".join(lines)
            return (
                code == 1
                and f"the replica on {Cluster.address(b)} is damaged (its directory" in text
                and "reports it unhealthy" in text
            )

        await wait_until(reported, 30, "verify to report the damaged replica and the unserved partition", 0.5)
        # b answers, but does not vote: a alone cannot decide, so nothing is served and nothing is cut.
        assert await cluster.max_transaction_id(a) == 299
        assert await cluster.max_transaction_id(b) == -1

        # Step 2: bring the partition's other replicas back; recovery decides with a and c, then catches b up.
        await asyncio.to_thread(c.restart)

        async def repaired() -> bool:
            return "partition 0: the damaged replica is repaired: it holds 0..299" in b.log_text()

        await wait_until(repaired, 60, "b's INFO line that its damaged replica is repaired", 0.5)
        status, _ = await asyncio.to_thread(http_get, b.http_port, "/health")
        assert status == 200

        # Step 3: it serves and replicates again, every transaction acknowledged before the cut included.
        second = await served(cluster, 2, 100)
        assert second.hwm == 399
        assert_identical(await settled_logs(cluster, cluster.storages, 399), 399)
        code, lines = await verify_lines(config)
        assert code == 0, lines

    asyncio.run(main())
