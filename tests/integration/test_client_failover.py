"""The server owning a partition is killed (SIGKILL) while clients append: its ZooKeeper session expires
(4000 ms), the partition moves to the other server with a higher generation, and the clients follow it and
finish, with no lost update and one order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import (
    CALLBACK_MODES,
    ClientTestCluster,
    CounterApp,
    Increment,
    counter_app,
    wait_until,
)
from waltz import WaltzClient
from waltz.cluster.membership import ClusterWatcher

pytestmark = pytest.mark.integration

NUM_CLIENTS = 2
NUM_PARTITIONS = 2
INCREMENTS_PER_CLIENT = 40
KILL_AFTER = 10
"""Transactions of partition 0 applied before the owner is killed."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", CALLBACK_MODES)
def test_clients_follow_a_partition_when_its_server_is_killed(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str, mode: str
) -> None:
    async def main() -> None:
        async with ClientTestCluster(
            tmp_path, zk, zk_connect_string, num_partitions=NUM_PARTITIONS, servers=2
        ) as cluster:
            async with ClusterWatcher(zk, cluster.root) as watcher:
                before = await watcher.wait_for(lambda e: len(e) == NUM_PARTITIONS, 30)
            apps = [counter_app(NUM_PARTITIONS, mode) for _ in range(NUM_CLIENTS)]
            config = cluster.client_config(callback_mode=mode)
            clients = [await asyncio.to_thread(WaltzClient, app, config) for app in apps]
            try:

                def work(client: WaltzClient, app: CounterApp) -> list[Increment]:
                    contexts = [Increment(app, i % NUM_PARTITIONS) for i in range(INCREMENTS_PER_CLIENT)]
                    for context in contexts:
                        client.submit(context)
                    client.flush_transactions(180)
                    return contexts

                runs = asyncio.gather(
                    *(asyncio.to_thread(work, c, a) for c, a in zip(clients, apps, strict=True))
                )
                await wait_until(lambda: len(apps[0].applied[0]) >= KILL_AFTER, 60, "appends before the kill")
                victim = cluster.server_at(before[0][0])
                victim.kill()
                contexts = [c for run in await runs for c in run]
                assert all(c.completed is True for c in contexts), [c.exception for c in contexts]
                per_partition = NUM_CLIENTS * INCREMENTS_PER_CLIENT // NUM_PARTITIONS
                await wait_until(
                    lambda: all(
                        len(a.applied[p]) == per_partition for a in apps for p in range(NUM_PARTITIONS)
                    ),
                    60,
                    "every client to apply every transaction",
                )
            finally:
                for client in clients:
                    await asyncio.to_thread(client.close)

            async with ClusterWatcher(zk, cluster.root) as watcher:
                after = await watcher.wait_for(lambda e: len(e) == NUM_PARTITIONS, 30)
            # Partition 0 moved to the surviving server, in a newer generation.
            assert after[0][0] != before[0][0]
            assert after[0][1] > before[0][1]
            expected = [str(n).encode() for n in range(1, per_partition + 1)]
            for p in range(NUM_PARTITIONS):
                assert apps[0].data(p) == expected
                for app in apps[1:]:
                    assert app.applied[p] == apps[0].applied[p]
            assert not [e for a in apps for e in a.errors]

    asyncio.run(main())
