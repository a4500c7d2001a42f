"""Backup and restore throughput (transactions/s) on a local cluster of real processes.

Starts ZooKeeper and three storage nodes (``waltz storage run``) in subprocesses on a temporary directory,
creates a cluster, then:

1. writes a synthetic full backup (``--partitions`` x ``--records`` transactions of ``--size`` bytes, random
   request ids and headers) with the backup format's writer (not timed);
2. **restore**: :func:`waltz.ops.restore.plan_restore` (every file checked against its manifest) and
   :func:`waltz.ops.restore.restore` into the empty cluster (every record to all three replicas, fsynced,
   read back and verified), timed together, as ``waltz restore`` runs them;
3. starts one server (``waltz server run``) and runs **backup** (:func:`waltz.ops.backup.backup`, as
   ``waltz backup`` does) of the restored cluster, timed;
4. checks the round trip: every partition file of the new backup is byte-identical to the synthetic one
   (same SHA-256).

    .venv/bin/python bench/backup_restore.py                       # 4 x 100,000 transactions of 100 bytes
    .venv/bin/python bench/backup_restore.py --records 250000 --size 512

The machine's load average is printed with the figures: wall-clock throughput on a shared host is a lower
bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.server_process import Cluster  # noqa: E402

from waltz.client.config import ClientConfig  # noqa: E402
from waltz.client.reader import LogReader  # noqa: E402
from waltz.cluster import zk as zkutil  # noqa: E402
from waltz.cluster.zkserver import ZooKeeperServer  # noqa: E402
from waltz.ops.backup import backup  # noqa: E402
from waltz.ops.backup_format import (  # noqa: E402
    BackupManifest,
    FileHeader,
    PartitionFileWriter,
    partition_file_name,
    write_manifest,
)
from waltz.ops.restore import plan_restore, restore  # noqa: E402
from waltz.ops.view import read_view  # noqa: E402
from waltz.protocol.record_run import encode_run  # noqa: E402
from waltz.protocol.records import crc32, make_record  # noqa: E402

BLOCK = 10_000


def synthetic_backup(directory: Path, key: uuid.UUID, partitions: int, records: int, size: int) -> None:
    directory.mkdir()
    rng = random.Random(42)
    entries = []
    for p in range(partitions):
        writer = PartitionFileWriter(directory / partition_file_name(p), FileHeader(p, key, 0, records - 1))
        for first in range(0, records, BLOCK):
            batch = []
            for i in range(first, min(records, first + BLOCK)):
                data = rng.randbytes(size)
                msb, lsb = rng.getrandbits(64), (p << 32) | (i & 0xFFFFFFFF)
                batch.append(make_record(i, msb, lsb, rng.getrandbits(31), data, crc32(data)))
            writer.add_run(first, len(batch), encode_run(batch))
        entries.append(writer.finish())
    write_manifest(directory, BackupManifest(uuid.uuid4(), 0, "bench", key, partitions, None, tuple(entries)))


async def wait_served(config: ClientConfig, partitions: int) -> None:
    async with LogReader(config) as reader:
        for p in range(partitions):
            await reader.high_water_mark(p)


async def run(args: argparse.Namespace) -> None:
    base = Path(tempfile.mkdtemp(prefix="waltz-backup-bench-", dir=args.dir))
    zks = ZooKeeperServer(base / "zk")
    zks.start()
    client = zkutil.connect(zks.connect_string, session_timeout_ms=10000)
    key = uuid.uuid4()
    cluster = Cluster(
        base / "cluster", client, zks.connect_string, num_partitions=args.partitions, cluster_key=key
    )
    try:
        await cluster.start(storages=3, servers=0)
        total = args.partitions * args.records
        source = base / "source-backup"
        synthetic_backup(source, key, args.partitions, args.records, args.size)
        load = os.getloadavg()
        print(
            f"{args.partitions} partitions x {args.records:,} transactions of {args.size} bytes, 3 replicas"
        )

        started = time.monotonic()
        plan = plan_restore([source])
        view = await asyncio.to_thread(read_view, client, cluster.root)
        result = await restore(client, view, plan)
        restore_s = time.monotonic() - started
        print(
            f"restore: {total:,} transactions in {restore_s:.2f} s = {total / restore_s:,.0f} txn/s "
            f"(writing {result.elapsed_s:.2f} s = {result.records_per_s:,.0f} txn/s; load average "
            f"{load[0]:.2f} before)"
        )

        await cluster.add_server()
        config = ClientConfig(zookeeper_connect_string=zks.connect_string, cluster_root=cluster.root)
        await wait_served(config, args.partitions)
        load = os.getloadavg()
        target = base / "backup"
        started = time.monotonic()
        done = await backup(config, target)
        backup_s = time.monotonic() - started
        print(
            f"backup:  {done.records:,} transactions in {backup_s:.2f} s = "
            f"{done.records / backup_s:,.0f} txn/s ({done.bytes / backup_s / 1e6:,.0f} MB/s; "
            f"load average {load[0]:.2f} before)"
        )
        original = {e.partition: e.sha256 for e in plan.manifests[0].partitions}
        copied = {e.partition: e.sha256 for e in done.manifest.partitions}
        if original != copied:
            raise SystemExit("round trip FAILED: the backup of the restored cluster differs from the source")
        print("round trip: every partition file byte-identical to the source backup")
        print(f"load average after: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    finally:
        cluster.stop()
        zkutil.close(client)
        zks.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--records", type=int, default=100_000, help="transactions per partition")
    parser.add_argument("--size", type=int, default=100, help="data bytes per transaction")
    parser.add_argument("--dir", default=None, help="where to put the temporary cluster")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
