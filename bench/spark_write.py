"""Batch write throughput of the Spark ``waltz`` sink with its default options.

Starts a local cluster (``waltz local``: ZooKeeper, one storage node, one server, two partitions) in a
temporary directory, then times ``df.write.format("waltz").mode("append").save()`` of ``--rows`` rows of
``--size`` bytes spread over the partitions, from Spark ``local[2]`` (two tasks), with no option but the
cluster's address: what a user gets without tuning. The first write pays the Python worker start-up; the
best and the median of the following ``--runs`` writes are reported, and the log is checked to hold every
row written. The process CPU time of the bench (driver side) is printed too, as the machine is shared.

Usage: ``.venv/bin/python bench/spark_write.py [--rows 100000] [--size 100] [--runs 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from waltz.client.reader import LogReader
from waltz.local import UpOptions, down, up
from waltz.spark.options import parse_options

PARTITIONS = 2


def spark_write(spark: Any, options: dict[str, str], rows: int, size: int) -> float:
    df = spark.range(rows, numPartitions=2).selectExpr(
        f"CAST(repeat('x', {size}) AS BINARY) AS data", f"CAST(id % {PARTITIONS} AS INT) AS partition"
    )
    df.cache().count()  # the rows exist before the clock starts: only the write is timed
    t0 = time.perf_counter()
    df.write.format("waltz").options(**options).mode("append").save()
    elapsed = time.perf_counter() - t0
    df.unpersist()
    return elapsed


async def log_size(options: dict[str, str]) -> int:
    async with LogReader(parse_options(options).client_config) as reader:
        return sum([await reader.high_water_mark(p) + 1 for p in range(PARTITIONS)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    directory = Path(tempfile.mkdtemp(prefix="waltz-spark-write-bench-"))
    cluster = up(UpOptions(directory=directory, storages=1, servers=1, partitions=PARTITIONS))
    try:
        options = {
            "waltz.zookeeper.connectString": cluster.zk_connect,
            "waltz.cluster.root": cluster.cluster_root,
        }
        from pyspark.sql import SparkSession

        import waltz.spark

        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.sql.shuffle.partitions", "2")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        waltz.spark.register(spark)
        load = os.getloadavg()[0]
        seconds = [spark_write(spark, options, args.rows, args.size) for _ in range(args.runs + 1)]
        written = asyncio.run(log_size(options))
        spark.stop()
        expected = args.rows * (args.runs + 1)
        if written != expected:
            raise SystemExit(f"the log holds {written:,} transactions, {expected:,} were written")
        warm = sorted(seconds[1:])
        print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; every row is in the log ({written:,})")
        print("| write | rows | seconds | rows/s |")
        print("|---|---:|---:|---:|")
        print(f"| first (cold workers) | {args.rows:,} | {seconds[0]:.2f} | {args.rows / seconds[0]:,.0f} |")
        for name, s in (("best", warm[0]), ("median", warm[len(warm) // 2])):
            print(f"| {name} of {args.runs} warm | {args.rows:,} | {s:.2f} | {args.rows / s:,.0f} |")
    finally:
        down(directory, purge=True)


if __name__ == "__main__":
    main()
