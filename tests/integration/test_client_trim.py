"""An application trims its partition through the client (issue 26): ``AsyncWaltzClient.trim`` and
``WaltzClient.trim`` raise the trim point in ZooKeeper under the rules of ``waltz cluster trim`` (only up,
never above the committed high-water mark + 1, never into the grace), and the owning server passes it on to
the replicas."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import ClientTestCluster, CounterApp, Tagged
from tests.integration.server_process import wait_until
from waltz import AsyncWaltzClient, WaltzClient
from waltz.cluster.trim_points import read_trim_points
from waltz.errors import MetadataError

pytestmark = pytest.mark.integration

RECORDS = 30


@pytest.mark.timeout(120)
def test_an_application_trims_its_partition_through_the_client(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    async def main() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect_string) as cluster:
            config = cluster.client_config()
            async with AsyncWaltzClient(CounterApp(1), config) as client:
                for i in range(RECORDS):
                    await client.submit(Tagged(b"t%d" % i))
                await client.flush_transactions(30)
                assert await client.high_water_mark(0) == RECORDS - 1
                with pytest.raises(MetadataError, match="trim point 31 is above the high-water mark 29"):
                    await client.trim(0, 31, min_kept_transactions=0)
                with pytest.raises(MetadataError, match="would keep fewer than the 1000 most recent"):
                    await client.trim(0, 10)
                assert read_trim_points(zk, cluster.root).of(0) == 0
                outcome = await client.trim(0, 20, min_kept_transactions=10)
                assert (outcome.before, outcome.after) == (0, 20)
                assert outcome.message == "partition 0: trim point raised from 0 to 20"
                again = await client.trim(0, 15, min_kept_transactions=10)
                assert (again.before, again.after) == (20, 20)
                assert "already trimmed to 20; nothing to do for 15" in again.message
            # The blocking client, from a thread.
            sync_outcome = await asyncio.to_thread(sync_trim, cluster, 25)
            assert (sync_outcome.before, sync_outcome.after) == (20, 25)
            assert read_trim_points(zk, cluster.root).of(0) == 25
            server = cluster.servers[0]
            await wait_until(
                lambda: "trim point 25 sent to replicas" in server.log_text(), 30, "the server to pass it on"
            )

    def sync_trim(cluster: ClientTestCluster, target: int) -> object:
        with WaltzClient(CounterApp(1), cluster.client_config()) as client:
            return client.trim(0, target, min_kept_transactions=5)

    asyncio.run(main())
