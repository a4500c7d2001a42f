"""A partition whose application lags far behind stops only its own feed: the other partitions on the same
server connection keep being fed and applied (real ZooKeeper, storage node and server processes).

Both partitions of the reading client live on one server, so their feeds share one stream connection. The
lagging partition's back pressure is its feed window (the client asks for the next one only once its core
took the last), which its inbox always holds, so the connection is never paused for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import (
    CALLBACK_MODES,
    ClientTestCluster,
    CounterApp,
    Tagged,
    wait_until,
)
from waltz import Transaction, WaltzClient
from waltz.protocol.client_server import FEED_WINDOW_MAX

pytestmark = pytest.mark.integration

BACKLOG = 2 * FEED_WINDOW_MAX
"""Transactions appended to the lagging partition while its application is stalled: more than a window,
so the window the client asks for next is a capped one."""
FIRST_WINDOW = 500  # server.minFetchSize: the window the reader gets after READY, with nothing to catch up
GATE_WAIT_S = 60.0


class GatedApp(CounterApp):
    """:class:`CounterApp` whose ``apply_transaction`` of partition 0 waits while the transaction's id is at
    or above ``open_below`` (polled: it must work on a callback thread and, inline, on the client's loop)."""

    def __init__(self, num_partitions: int, inline: bool) -> None:
        super().__init__(num_partitions)
        self.open_below = 0
        self._inline = inline
        self._lock = threading.Lock()

    def _held(self, transaction: Transaction) -> bool:
        with self._lock:
            return transaction.partition_id == 0 and transaction.transaction_id >= self.open_below

    def open(self, below: int) -> None:
        with self._lock:
            self.open_below = below

    def apply_transaction(self, transaction: Transaction) -> None:
        if self._inline:
            return self._apply_inline(transaction)  # type: ignore[return-value]
        deadline = time.monotonic() + GATE_WAIT_S
        while self._held(transaction) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._apply(transaction, transaction.get_transaction_data())
        return None

    async def _apply_inline(self, transaction: Transaction) -> None:
        deadline = time.monotonic() + GATE_WAIT_S
        # Polled: the test opens the gate from another thread than the client's loop.
        while self._held(transaction) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        self._apply(transaction, await transaction.fetch_transaction_data())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", CALLBACK_MODES)
def test_a_lagging_partition_does_not_stop_the_feed_of_another_partition_on_its_connection(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str, mode: str
) -> None:
    async def main() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect_string, num_partitions=2) as cluster:
            app = GatedApp(2, inline=mode == "inline")
            reader = await asyncio.to_thread(
                WaltzClient, app, cluster.client_config(callback_mode=mode, feed_queue_size=50)
            )
            writer_app = CounterApp(2)
            writer = await asyncio.to_thread(
                WaltzClient, writer_app, cluster.client_config(max_concurrent_transactions=64)
            )
            try:
                # Both partitions READY on the reader, fed and applied (one append each, of its own); the
                # first feed window of partition 0 then holds ids 0..FIRST_WINDOW-1, and its application
                # stops at id 1.
                app.open(1)
                await asyncio.to_thread(reader.submit_many, [Tagged(b"r", 0), Tagged(b"r", 1)])
                await asyncio.to_thread(reader.flush_transactions, 30)
                await asyncio.to_thread(writer.submit_many, [Tagged(b"p0", 0) for _ in range(BACKLOG)])
                await asyncio.to_thread(writer.flush_transactions, 60)
                # The reader applies its first window, asks for the next one (about BACKLOG - FIRST_WINDOW
                # behind, so a full window comes) and stalls again at FIRST_WINDOW + 50: the window waits in
                # the reader, at most FEED_WINDOW_MAX of it.
                stall_at = FIRST_WINDOW + 50
                app.open(stall_at)
                await wait_until(lambda: app.hwm[0] == stall_at - 1, 30, "partition 0 to reach the gate")
                await asyncio.sleep(0.5)  # the next window arrives meanwhile
                # Partition 1 is fed and applied while partition 0's application is stalled.
                await asyncio.to_thread(writer.submit_many, [Tagged(b"p1", 1) for _ in range(20)])
                await asyncio.to_thread(writer.flush_transactions, 30)
                await asyncio.to_thread(reader.wait_applied, 1, 20, 15)
                assert app.hwm[0] == stall_at - 1  # still stalled
                # Partition 0 catches up once its application moves again, window by window.
                app.open(BACKLOG + 1)
                await asyncio.to_thread(reader.wait_applied, 0, BACKLOG, 60)
            finally:
                app.open(BACKLOG + 1)  # A failed run must not leave close waiting at the gate.
                await asyncio.to_thread(reader.close)
                await asyncio.to_thread(writer.close)
            assert app.data(0) == [b"r"] + [b"p0"] * BACKLOG
            assert app.data(1) == [b"r"] + [b"p1"] * 20
            assert not app.errors

    asyncio.run(main())
