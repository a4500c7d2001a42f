"""Sizing figures for docs/deploy.md: disk bytes per transaction per replica, and the memory of the
processes, after appending N transactions of a given size to a ``waltz local`` cluster.

    .venv/bin/python -m bench.sizing [--txns 100000] [--txn-size 512] [--partitions 4]

Prints one JSON object: the storage directories' logical bytes (file sizes) and allocated bytes (blocks)
per transaction per replica, measured after a clean stop (which cuts each partition's newest segment to its
last record: while running it is zero-filled up to ``storage.segment.preallocateBytes``, 4 MiB, ahead), and
each server's and storage node's resident memory (VmRSS) before and after the appends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from procstat import rss_bytes
from waltz import local
from waltz.local.state import LocalCluster


def disk_bytes(directory: Path) -> tuple[int, int]:
    """(logical bytes, allocated bytes) of every file under ``directory``."""
    logical = allocated = 0
    for root, _, files in os.walk(directory):
        for name in files:
            st = os.stat(os.path.join(root, name))
            logical += st.st_size
            allocated += st.st_blocks * 512
    return logical, allocated


def memory(cluster: LocalCluster) -> dict[str, list[int]]:
    return {
        "storage_rss_bytes": [rss_bytes(s.pid) for s in cluster.storages],
        "server_rss_bytes": [rss_bytes(s.pid) for s in cluster.servers],
    }


def disks(cluster: LocalCluster) -> list[tuple[int, int]]:
    return [disk_bytes(Path(s.data_dir)) for s in cluster.storages]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sizing", description=__doc__.split("\n")[0])
    parser.add_argument("--txns", type=int, default=100_000)
    parser.add_argument("--txn-size", type=int, default=512)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="waltz-sizing-") as tmp:
        directory = Path(tmp) / "cluster"
        local.up(local.UpOptions(directory=directory, partitions=args.partitions))
        try:
            cluster = LocalCluster.load(directory)
            local.down(directory)  # a clean stop: the newest segments cut to their last record
            local.restart(directory)
            cluster = LocalCluster.load(directory)
            disk_before, memory_before = disks(cluster), memory(cluster)
            per_client = args.txns // args.clients
            subprocess.run(
                [
                    sys.executable, "-m", "waltz.cli.main", "perf", "producer",
                    "-c", str(directory / "client.yaml"), "--txn-size", str(args.txn_size),
                    "--txns-per-client", str(per_client), "--clients", str(args.clients),
                    "--partitions", str(args.partitions), "--lock-pool-size", "0", "--json",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
            memory_after = memory(cluster)
        finally:
            local.down(directory)
        disk_after = disks(cluster)
    txns = per_client * args.clients
    added = [(a[0] - b[0]) / txns for a, b in zip(disk_after, disk_before, strict=True)]
    allocated = [(a[1] - b[1]) / txns for a, b in zip(disk_after, disk_before, strict=True)]
    print(
        json.dumps(
            {
                "txns": txns,
                "txn_size": args.txn_size,
                "logical_bytes_per_txn_per_replica": [round(x, 1) for x in added],
                "allocated_bytes_per_txn_per_replica": [round(x, 1) for x in allocated],
                "memory_before": memory_before,
                "memory_after": memory_after,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
