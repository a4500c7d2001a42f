"""Append latency while a trim deletes a gigabyte: p50/p99 of appends through the public client, without and
with a concurrent trim that deletes ``--fill-mb`` of segments on every replica, and the disk space the
storage nodes report (``waltz_storage_disk_bytes``) before and after.

Starts ZooKeeper, three storage nodes (segments of ``--segment-mb``) and one server (real processes, through
the integration fixtures ``tests/integration/server_process.py``), sets the grace to 0 (the trim is in force
at once: the grace only delays *when* the deletion runs, not what it costs), fills partition 0 with
``--fill-mb`` of transactions of ``--fill-kb``, then measures ``--seconds`` of appends of 512 bytes, one at a
time (submit, wait for its completion), twice: first with nothing else going on, then right after
``waltz cluster trim --to`` (the library call) raised the trim point above everything filled. Prints
p50/p99/max per phase, when each node's disk bytes dropped, and the bytes freed.

    .venv/bin/python bench/trim_p99.py                       # 1100 MB filled, 64 MB segments
    .venv/bin/python bench/trim_p99.py --fill-mb 100 --seconds 5
    .venv/bin/python bench/trim_p99.py --delete-mb-per-s 0   # unpaced deletion, for comparison

Wall-clock figures: the machine is shared, so the load average is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from kazoo.client import KazooClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scratch import run_in_temp_dir, zookeeper  # noqa: E402
from tests.integration.client_cluster import CounterApp, Tagged  # noqa: E402
from tests.integration.server_process import Cluster, free_port  # noqa: E402

from waltz import WaltzClient  # noqa: E402
from waltz.client.config import ClientConfig  # noqa: E402
from waltz.cluster.retention import update_retention  # noqa: E402
from waltz.cluster.zkserver import ZooKeeperServer  # noqa: E402
from waltz.ops.trim import trim_partition  # noqa: E402


def disk_bytes(http_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("waltz_storage_disk_bytes "))
    return float(line.split()[1])


def measure(client: WaltzClient, seconds: float) -> list[tuple[float, float]]:
    """(start on the monotonic clock, latency in ms) of one-at-a-time appends of 512 bytes for ``seconds``."""
    out: list[tuple[float, float]] = []
    payload = b"m" * 512
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ctx = Tagged(payload)
        started = time.monotonic()
        client.submit(ctx)
        if not ctx.ended.wait(60) or not ctx.completed:
            raise SystemExit(f"append failed: {ctx.exception!r}")
        out.append((started, (time.monotonic() - started) * 1000))
    return out


def timeline(samples: list[tuple[float, float]], t0: float, seconds: float = 6.0, step: float = 0.5) -> str:
    """Appends and their worst latency in each ``step`` s after ``t0`` (where a stall would show)."""
    cells = []
    for i in range(int(seconds / step)):
        lat = [ms for at, ms in samples if t0 + i * step <= at < t0 + (i + 1) * step]
        cells.append(f"{len(lat)}/{max(lat, default=0):.0f}")
    return " ".join(cells)


def summary(name: str, samples: list[tuple[float, float]]) -> str:
    lat = [ms for _, ms in samples]
    if len(lat) < 2:
        return f"{name}: {len(lat)} appends"
    q = statistics.quantiles(lat, n=100)
    return (
        f"{name}: {len(lat)} appends, p50 {q[49]:.2f} ms, p99 {q[98]:.2f} ms, max {max(lat):.2f} ms "
        f"(load average {os.getloadavg()[0]:.1f})"
    )


async def run(args: argparse.Namespace, base: Path) -> None:
    with zookeeper(base) as (zks, zk):
        await _measure(args, base, zks, zk)


async def _measure(args: argparse.Namespace, base: Path, zks: ZooKeeperServer, zk: KazooClient) -> None:
    cluster = Cluster(
        base,
        zk,
        zks.connect_string,
        storage_config={
            "storage.segment.size.threshold": args.segment_mb * 1024 * 1024,
            **(
                {}
                if args.delete_mb_per_s is None
                else {"storage.trim.deleteBytesPerSecond": args.delete_mb_per_s * 1024 * 1024}
            ),
        },
    )
    try:
        for _ in range(3):
            cluster.storage_config["storage.http.port"] = free_port()
            await cluster.add_storage()
        await cluster.add_server()
        update_retention(zk, cluster.root, grace_ms=0)
        config = ClientConfig(
            zookeeper_connect_string=zks.connect_string,
            cluster_root=cluster.root,
            max_concurrent_transactions=64,
        )
        client = await asyncio.to_thread(WaltzClient, CounterApp(1), config)
        try:
            await asyncio.to_thread(phases, args, cluster, zk, client)
        finally:
            await asyncio.to_thread(client.close)
    finally:
        cluster.stop()


def phases(args: argparse.Namespace, cluster: Cluster, zk: KazooClient, client: WaltzClient) -> None:
    payload = b"f" * (args.fill_kb * 1024)
    count = args.fill_mb * 1024 // args.fill_kb
    started = time.monotonic()
    for first in range(0, count, 500):
        client.submit_many([Tagged(payload) for _ in range(min(500, count - first))])
    client.flush_transactions(1800)
    fill_s = time.monotonic() - started
    ports = [sp.http_port for sp in cluster.storages]
    # A replica that fell behind during the fill catches up first: measuring during its catch-up would
    # show that, not the trim.
    while min(disk_bytes(p) for p in ports) < args.fill_mb * 2**20:
        time.sleep(0.5)
    time.sleep(args.settle_s)
    before = [disk_bytes(p) for p in ports]
    print(
        f"filled {count} transactions of {args.fill_kb} KB ({args.fill_mb} MB) in {fill_s:.0f} s; caught up, "
        f"disk bytes "
        f"per node {[f'{b / 2**20:.0f} MiB' for b in before]}"
    )
    quiet = measure(client, args.seconds)
    print(summary("no trim", quiet))
    print(f"  appends/worst ms per 0.5 s from its start: {timeline(quiet, quiet[0][0])}")
    # --control trims to 1: the same trim machinery and metric polling, nothing deleted.
    trim_to = 1 if args.control else client.high_water_mark(0) + 1
    done: dict[int, float] = {}

    def watch() -> None:
        while len(done) < len(ports) and time.monotonic() - t0 < (6 if args.control else 600):
            for i, p in enumerate(ports):
                if i not in done and disk_bytes(p) < before[i] - args.fill_mb * 2**20 * 0.9:
                    done[i] = time.monotonic() - t0
            time.sleep(0.25)

    t0 = time.monotonic()
    outcome = trim_partition(zk, cluster.root, 0, to=trim_to, min_kept_transactions=0)
    watcher = threading.Thread(target=watch)
    watcher.start()
    lat = measure(client, args.seconds)
    watcher.join()
    after = [disk_bytes(p) for p in ports]
    print(outcome.message)
    print(summary("with trim, the whole phase", lat))
    print(f"  appends/worst ms per 0.5 s from the trim: {timeline(lat, t0)}")
    end = t0 + max(done.values(), default=0.0)
    print(summary("with trim, while the nodes deleted", [x for x in lat if t0 <= x[0] <= end]))
    freed = [
        f"{(b - a) / 2**20:.0f} MiB in {done.get(i, float('nan')):.2f} s"
        for i, (b, a) in enumerate(zip(before, after, strict=True))
    ]
    print(f"waltz_storage_disk_bytes dropped per node: {freed}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fill-mb", type=int, default=1100, help="MB to fill, then trim (per replica)")
    parser.add_argument("--fill-kb", type=int, default=256, help="KB per filling transaction")
    parser.add_argument("--segment-mb", type=int, default=64, help="storage.segment.size.threshold, MB")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of appends per phase")
    parser.add_argument(
        "--delete-mb-per-s",
        type=int,
        default=None,
        help="storage.trim.deleteBytesPerSecond in MiB/s (default: the node's, 64; 0: unpaced)",
    )
    parser.add_argument("--control", action="store_true", help="trim to 1 (deletes nothing), to compare")
    parser.add_argument("--settle-s", type=float, default=5.0, help="quiet seconds before measuring")
    parser.add_argument("--dir", default=None, help="parent of the temporary directory")
    args = parser.parse_args()
    run_in_temp_dir("waltz-trim-p99-", args.dir, lambda base: run(args, base))


if __name__ == "__main__":
    main()
