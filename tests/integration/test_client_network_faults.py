"""ServerClientNetworkFaultTest (REFERENCE §8.1): a TCP proxy between the clients and their server is cut
again and again while they append; every submitted context must end up committed exactly once, and each
client must apply the log densely, in order."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import (
    CALLBACK_MODES,
    ClientTestCluster,
    RewritingDiscovery,
    Tagged,
    counter_app,
    wait_until,
)
from tests.integration.tcp_proxy import TcpProxy
from waltz import WaltzClient
from waltz.client.network import NetworkDriver
from waltz.client.reader import LogReader

pytestmark = pytest.mark.integration

MIN_CONTEXTS_PER_CLIENT = 100
MAX_CONTEXTS_PER_CLIENT = 2000
MIN_OUTAGES = 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", CALLBACK_MODES)
def test_contexts_commit_exactly_once_while_the_network_is_cut_repeatedly(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str, mode: str
) -> None:
    rng = random.Random(20240611)

    async def main() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect_string) as cluster:
            proxy = await TcpProxy.start_to(cluster.servers[0].port)
            # Client 0 has one context in flight at a time, so its log order must be its submission order;
            # client 1 keeps five in flight, so its appends race their own retries.
            configs = [
                cluster.client_config(max_concurrent_transactions=1, callback_mode=mode),
                cluster.client_config(max_concurrent_transactions=5, callback_mode=mode),
            ]
            apps = [counter_app(1, mode), counter_app(1, mode)]
            clients = []
            for app, config in zip(apps, configs, strict=True):
                driver = NetworkDriver(
                    config, discovery=RewritingDiscovery(config, lambda _e: proxy.endpoint)
                )
                clients.append(await asyncio.to_thread(WaltzClient, app, config, driver=driver))
            contexts: list[list[Tagged]] = [[] for _ in clients]
            faults_done = threading.Event()

            async def faults() -> None:
                while proxy.cuts < MIN_OUTAGES:
                    await asyncio.sleep(rng.uniform(0.1, 0.4))
                    # What the clients send in the last moment before the cut is lost on the way (a fast
                    # commit path otherwise leaves a cut little to catch in flight): they must find out
                    # from the feed after re-mounting and retry it.
                    proxy.swallow()
                    await asyncio.sleep(0.05)
                    await proxy.outage(rng.uniform(0.05, 0.4))
                faults_done.set()

            def submit_all(n: int, client: WaltzClient) -> None:
                # Keep appending for as long as the outages go on.
                while len(contexts[n]) < MAX_CONTEXTS_PER_CLIENT and (
                    len(contexts[n]) < MIN_CONTEXTS_PER_CLIENT or not faults_done.is_set()
                ):
                    context = Tagged(f"c{n}-{len(contexts[n])}".encode())
                    contexts[n].append(context)
                    client.submit(context)
                client.flush_transactions(180)

            fault_task = asyncio.create_task(faults())
            try:
                await asyncio.gather(*(asyncio.to_thread(submit_all, n, c) for n, c in enumerate(clients)))
                await fault_task
                for batch in contexts:
                    assert all(c.completed is True for c in batch), [c.exception for c in batch]
                async with LogReader(cluster.client_config()) as reader:
                    records = [r async for r in reader.read(0)]
                total = len(records)
                await wait_until(
                    lambda: all(app.hwm[0] == total - 1 for app in apps), 60, "both clients to apply the log"
                )
            finally:
                fault_task.cancel()
                for client in clients:
                    await asyncio.to_thread(client.close)
                await proxy.aclose()

            tags = [r.data for r in records]
            # Exactly once: every context's tag is in the log once, and nothing else is.
            assert sorted(tags) == sorted(c.tag for batch in contexts for c in batch)
            # In order: client 0's contexts committed in submission order.
            assert [t for t in tags if t.startswith(b"c0-")] == [c.tag for c in contexts[0]]
            # Both clients applied the whole log, densely and in order.
            for app in apps:
                assert app.applied[0] == [(r.transaction_id, r.data) for r in records]
                assert not app.errors
            # Appends were lost with the connections, found out by the flush after re-mounting, and retried.
            assert any(c.executions > 1 for batch in contexts for c in batch)
            assert proxy.cuts >= MIN_OUTAGES
            assert proxy.relayed > 4  # The clients reconnected after the outages.

    asyncio.run(main())
