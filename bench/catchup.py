"""Catch-up speed: a new application instance replays a partition from id 0, fetching every transaction's
data as the client tutorial (docs/client.md) does, through the public client.

Starts ZooKeeper, ``--storages`` storage nodes and one Waltz server (real processes, through the integration
test fixtures ``tests/integration/client_cluster.py``), appends ``--count`` transactions of ``--size`` bytes
to partition 0 with one client, closes it, then opens a fresh client with an empty state (high-water mark -1)
whose ``apply_transaction`` calls ``transaction.get_transaction_data()`` and counts. Prints the replay's
transactions/s (from the client's construction to the last transaction applied), the single data requests
and range reads the client made, and the answer-timeout warnings the replay logged (none expected).

    .venv/bin/python bench/catchup.py                       # 100,000 transactions of 512 bytes
    .venv/bin/python bench/catchup.py --count 20000 --size 64

Wall-clock figures: run it on an idle machine (it prints the load average before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scratch import run_in_temp_dir, zookeeper  # noqa: E402
from tests.integration.client_cluster import ClientTestCluster, Tagged  # noqa: E402

from waltz import Transaction, WaltzClient  # noqa: E402
from waltz.client.api import ClientCallbacks  # noqa: E402
from waltz.client.network import NetworkDriver  # noqa: E402
from waltz.protocol.records import Record  # noqa: E402


class Replayer(ClientCallbacks):
    """An application with an empty database: applies every transaction with its data."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hwm = -1
        self.data_bytes = 0

    def client_high_water_mark(self, partition_id: int) -> int:
        with self.lock:
            return self.hwm

    def apply_transaction(self, transaction: Transaction) -> None:
        data = transaction.get_transaction_data()
        with self.lock:
            self.data_bytes += len(data)
            self.hwm = transaction.transaction_id

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        raise SystemExit(f"partition {partition_id} transaction {transaction_id}: {exception!r}")


class Counting(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.timeouts = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "client.answerTimeout" in record.getMessage():
            self.timeouts += 1


def _count_requests() -> dict[str, int]:
    """Count the driver's single data requests and range reads (wrapping the real methods)."""
    counts = {"single": 0, "ranges": 0}
    fetch = NetworkDriver.fetch_transaction_data
    read_range = NetworkDriver.read_range

    async def counted_fetch(self: NetworkDriver, partition_id: int, transaction_id: int) -> tuple[bytes, int]:
        counts["single"] += 1
        return await fetch(self, partition_id, transaction_id)

    async def counted_range(
        self: NetworkDriver, partition_id: int, start: int, max_count: int
    ) -> list[Record]:
        counts["ranges"] += 1
        return await read_range(self, partition_id, start, max_count)

    NetworkDriver.fetch_transaction_data = counted_fetch  # type: ignore[method-assign]
    NetworkDriver.read_range = counted_range  # type: ignore[method-assign]
    return counts


async def run(args: argparse.Namespace, base: Path) -> None:
    with zookeeper(base) as (zks, zk):
        async with ClientTestCluster(base, zk, zks.connect_string, storages=args.storages) as cluster:
            writer = await asyncio.to_thread(
                WaltzClient, Replayer(), cluster.client_config(max_concurrent_transactions=256)
            )
            started = time.monotonic()
            try:
                payload = b"x" * args.size
                for first in range(0, args.count, 10000):
                    batch = [Tagged(payload, 0) for _ in range(min(10000, args.count - first))]
                    await asyncio.to_thread(writer.submit_many, batch)
                await asyncio.to_thread(writer.flush_transactions, 600)
            finally:
                await asyncio.to_thread(writer.close)
            append_s = time.monotonic() - started
            print(f"appended {args.count} transactions of {args.size} bytes in {append_s:.1f} s")
            counts = _count_requests()
            timeouts = Counting()
            logging.getLogger("waltz.client").addHandler(timeouts)
            app = Replayer()
            load = os.getloadavg()[0]
            started = time.monotonic()
            reader = await asyncio.to_thread(WaltzClient, app, cluster.client_config())
            try:
                await asyncio.to_thread(reader.wait_applied, 0, args.count - 1, 900)
                replay_s = time.monotonic() - started
            finally:
                await asyncio.to_thread(reader.close)
            assert app.data_bytes == args.count * args.size, app.data_bytes
            print(
                f"catch-up: {args.count} transactions with data in {replay_s:.2f} s = "
                f"{args.count / replay_s:,.0f} transactions/s; {counts['single']} single data requests, "
                f"{counts['ranges']} range reads; {timeouts.timeouts} answer timeouts; "
                f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=100_000, help="transactions to append and replay")
    parser.add_argument("--size", type=int, default=512, help="bytes of data per transaction")
    parser.add_argument("--storages", type=int, default=3, help="storage nodes")
    parser.add_argument("--dir", default=None, help="parent of the temporary directory")
    args = parser.parse_args()
    run_in_temp_dir("waltz-catchup-", args.dir, lambda base: run(args, base))


if __name__ == "__main__":
    main()
