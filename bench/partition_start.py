"""Many partitions on one server: start-up time and memory per partition, against a real cluster.

Starts a ``waltz local`` cluster (ZooKeeper, 3 storage nodes, 1 server) with ``--partitions`` partitions
(default 1,000) and another with ``--baseline`` partitions (default 4), in temporary
directories, one after the other.
For each it prints:

* ``up``: the whole ``waltz local up`` (ZooKeeper, storage nodes, server, until every partition is served);
* ``restart``: the server killed (SIGKILL) and started again: from its spawn to every partition reported
  served by its ``/health`` (each partition owned again, its store session open after recovery), and the
  server's CPU time until then (user + system, independent of the machine's load, unlike the wall time);
* ``appended``: one append to every partition through one :class:`~waltz.AsyncWaltzClient`, from the client's
  start to the last ``on_completion``;
* the server's resident memory (VmRSS of ``/proc/<pid>/status``) after the appends, and the storage nodes';
* ``idle``: the server's CPU over ``IDLE_S`` seconds with nothing to do (what its partitions' timers cost);
* ``/metrics``: the size of the server's Prometheus text, the server CPU one scrape takes, and the longest
  ``/ping`` round trip while the scrape was made (``/ping`` is answered on the server's event loop, so this is
  how long a scrape held up everything else the server does).

Memory per partition is ``(server RSS at --partitions - server RSS at --baseline) / (difference in
partitions)``: what one more partition costs a server, without the interpreter's own footprint. The load
average is printed at the start and the end (the times are wall clock; under load they stretch).

    .venv/bin/python bench/partition_start.py                  # 1,000 partitions against 4
    .venv/bin/python bench/partition_start.py --partitions 256
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.procstat import cpu_s, rss_bytes  # noqa: E402

from waltz import (  # noqa: E402
    AsyncWaltzClient,
    ClientCallbacks,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
)
from waltz.local import cluster as local  # noqa: E402
from waltz.local import probe  # noqa: E402

START_TIMEOUT_S = 300.0
IDLE_S = 5.0


class _Callbacks(ClientCallbacks):
    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, transaction: Transaction) -> None:
        pass

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        print(f"apply failed: {exception!r}", file=sys.stderr)


class _Append(TransactionContext):
    def __init__(self, partition: int, done: asyncio.Future[bool]) -> None:
        super().__init__()
        self._partition = partition
        self._done = done

    def partition_id(self, num_partitions: int) -> int:
        return self._partition

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data(b"x" * 64)
        return True

    def on_completion(self, result: bool) -> None:
        if not self._done.done():
            self._done.set_result(result)


async def append_everywhere(config: ClientConfig, partitions: int) -> int:
    """One append to every partition; returns how many committed."""
    loop = asyncio.get_running_loop()
    async with AsyncWaltzClient(_Callbacks(), config) as client:
        futures = [loop.create_future() for _ in range(partitions)]
        for p, future in enumerate(futures):
            await client.submit(_Append(p, future))
        results = await asyncio.wait_for(asyncio.gather(*futures), START_TIMEOUT_S)
    return sum(results)


def wait_all_served(port: int, partitions: int, timeout_s: float) -> None:
    wanted = set(range(partitions))
    deadline = time.monotonic() + timeout_s
    while not wanted <= probe.served_partitions(port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every partition was served within {timeout_s:g} s")
        time.sleep(0.05)


@dataclass
class Figures:
    partitions: int
    up_s: float
    restart_s: float
    restart_cpu_s: float
    appended_s: float
    committed: int
    server_rss: int
    storage_rss: list[int]
    idle_cpu_s: float
    """Server CPU seconds per second, idle (after the appends)."""
    metrics_bytes: int
    metrics_cpu_s: float
    metrics_ping_s: float
    """The longest /ping round trip while /metrics was being made."""

    def line(self) -> str:
        mib = 1 << 20
        return (
            f"{self.partitions:5} partitions: up {self.up_s:6.1f} s, server restart to all served "
            f"{self.restart_s:6.1f} s (server CPU {self.restart_cpu_s:5.1f} s), "
            f"one append each {self.appended_s:5.1f} s "
            f"({self.committed} committed); "
            f"server RSS {self.server_rss / mib:6.1f} MiB, storage RSS "
            f"{', '.join(f'{r / mib:.1f}' for r in self.storage_rss)} MiB; "
            f"idle server CPU {100 * self.idle_cpu_s:.1f}% of a core; "
            f"/metrics {self.metrics_bytes / 1e6:.2f} MB "
            f"in {self.metrics_cpu_s:.2f} s of server CPU, /ping meanwhile at most "
            f"{1000 * self.metrics_ping_s:.0f} ms"
        )


def scrape_with_pings(port: int) -> tuple[bytes, float]:
    """The server's /metrics text, and the longest /ping round trip from another thread while it was made."""
    done = threading.Event()
    longest = [0.0]

    def ping() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            probe.http_get(port, "/ping", START_TIMEOUT_S)
            longest[0] = max(longest[0], time.perf_counter() - t0)

    pinger = threading.Thread(target=ping, name="ping")
    pinger.start()
    try:
        body = probe.http_get(port, "/metrics", START_TIMEOUT_S)[1]
    finally:
        done.set()
        pinger.join()
    return body, longest[0]


def measure(partitions: int) -> Figures:
    """Start a cluster of ``partitions`` partitions on one server and measure it (see the module docstring);
    the cluster is gone when this returns. ``tests/integration/test_many_partitions.py`` asserts on it."""
    with tempfile.TemporaryDirectory(prefix="waltz-partition-start-") as tmp:
        t0 = time.perf_counter()
        opts = local.UpOptions(
            directory=Path(tmp) / "cluster",
            storages=3,
            servers=1,
            partitions=partitions,
            start_timeout_s=START_TIMEOUT_S,
        )
        cluster = local.up(opts)
        up_s = time.perf_counter() - t0
        try:
            local.kill(cluster.directory, "server", 0)
            t0 = time.perf_counter()
            rec = local.start(cluster.directory, "server", 0, START_TIMEOUT_S)
            assert rec.http_port is not None
            wait_all_served(rec.http_port, partitions, START_TIMEOUT_S)
            restart_s = time.perf_counter() - t0
            restart_cpu_s = cpu_s(rec.pid or 0)
            config = ClientConfig.from_yaml(Path(cluster.directory) / "client.yaml")
            t0 = time.perf_counter()
            committed = asyncio.run(append_everywhere(config, partitions))
            appended_s = time.perf_counter() - t0
            storages = local.LocalCluster.load(cluster.directory).storages
            idle0 = cpu_s(rec.pid or 0)
            time.sleep(IDLE_S)
            idle_cpu_s = (cpu_s(rec.pid or 0) - idle0) / IDLE_S
            scrape0 = cpu_s(rec.pid or 0)
            metrics, metrics_ping_s = scrape_with_pings(rec.http_port)
            metrics_cpu_s = cpu_s(rec.pid or 0) - scrape0
            return Figures(
                partitions,
                up_s,
                restart_s,
                restart_cpu_s,
                appended_s,
                committed,
                rss_bytes(rec.pid or 0),
                [rss_bytes(s.pid or 0) for s in storages],
                idle_cpu_s,
                len(metrics),
                metrics_cpu_s,
                metrics_ping_s,
            )
        finally:
            local.down(cluster.directory, purge=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--baseline", type=int, default=4)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    base = measure(args.baseline)
    print(base.line(), flush=True)
    many = measure(args.partitions)
    print(many.line(), flush=True)
    per = (many.server_rss - base.server_rss) / (args.partitions - args.baseline)
    per_storage = (sum(many.storage_rss) - sum(base.storage_rss)) / 3 / (args.partitions - args.baseline)
    print(
        f"per partition: server {per / 1024:.0f} KiB, storage node {per_storage / 1024:.0f} KiB",
        flush=True,
    )
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
