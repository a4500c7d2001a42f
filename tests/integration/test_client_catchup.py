"""A new application instance replays a partition from id 0 with its data (real ZooKeeper, storage node and
server processes): the data comes in range reads, not one request per transaction, and a catch-up that
streams for many answer timeouts never trips ``client.answerTimeout``."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import ClientTestCluster, CounterApp, Tagged
from waltz import Transaction, WaltzClient
from waltz.client.network import NetworkDriver

pytestmark = pytest.mark.integration

BACKLOG = 20000
ANSWER_TIMEOUT_MS = 300
APPLY_S = 0.0002
"""Each apply's pause (on a callback thread): the catch-up takes at least BACKLOG * APPLY_S = 4 s, thirteen
answer timeouts."""


class SlowApp(CounterApp):
    def apply_transaction(self, transaction: Transaction) -> None:
        time.sleep(APPLY_S)
        super().apply_transaction(transaction)


@pytest.mark.timeout(180)
def test_a_new_instance_replays_with_data_in_ranges_and_never_trips_the_answer_timeout(
    tmp_path: Path,
    zk: KazooClient,
    zk_connect_string: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    single = 0
    fetch = NetworkDriver.fetch_transaction_data

    async def counted(self: NetworkDriver, partition_id: int, transaction_id: int) -> tuple[bytes, int]:
        nonlocal single
        single += 1
        return await fetch(self, partition_id, transaction_id)

    monkeypatch.setattr(NetworkDriver, "fetch_transaction_data", counted)

    async def main() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect_string) as cluster:
            writer = await asyncio.to_thread(
                WaltzClient, CounterApp(1), cluster.client_config(max_concurrent_transactions=64)
            )
            try:
                tags = [str(i).encode() for i in range(BACKLOG)]
                await asyncio.to_thread(writer.submit_many, [Tagged(t, 0) for t in tags])
                await asyncio.to_thread(writer.flush_transactions, 60)
            finally:
                await asyncio.to_thread(writer.close)
            written = single
            app = SlowApp(1)
            config = cluster.client_config(answer_timeout_ms=ANSWER_TIMEOUT_MS, feed_queue_size=50)
            caplog.set_level(logging.WARNING, logger="waltz.client")
            started = time.monotonic()
            reader = await asyncio.to_thread(WaltzClient, app, config)
            try:
                await asyncio.to_thread(reader.wait_applied, 0, BACKLOG - 1, 120)
            finally:
                await asyncio.to_thread(reader.close)
            assert time.monotonic() - started > 2 * ANSWER_TIMEOUT_MS / 1000  # A long catch-up, as meant.
            assert app.data(0) == tags
            assert not app.errors
            timeouts = [r.getMessage() for r in caplog.records if "client.answerTimeout" in r.getMessage()]
            assert not timeouts, timeouts
            # A handful of single data requests while the readahead window grows, then range reads.
            assert single - written < 20, single - written

    asyncio.run(main())
