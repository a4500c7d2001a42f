"""Batch write throughput of the Spark ``waltz`` sink with its default options.

Starts a local cluster (``spark_bench.waltz_cluster``: ZooKeeper, one storage node, one server, two
partitions), then times ``df.write.format("waltz").mode("append").save()`` of ``--rows`` rows of ``--size``
bytes spread over the partitions, from Spark ``local[2]`` (two tasks), with no option but the cluster's
address: what a user gets without tuning. The first write pays the Python worker start-up; the best and the
median of the following ``--runs`` writes are reported, with the CPU seconds per write of the Spark
processes (JVM and Python workers) and of the cluster (server and storage node), and the log is checked to
hold every row written.

Usage: ``.venv/bin/python bench/spark_write.py [--rows 100000] [--size 100] [--runs 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from spark_bench import PARTITIONS, BenchCluster, cpu_seconds, median, spark_session, waltz_cluster
from waltz.client.reader import LogReader
from waltz.spark.options import parse_options


def spark_write(spark: Any, cluster: BenchCluster, rows: int, size: int) -> tuple[float, dict[str, float]]:
    """Seconds and CPU seconds (per side) of one write of ``rows`` rows."""
    df = spark.range(rows, numPartitions=2).selectExpr(
        f"CAST(repeat('x', {size}) AS BINARY) AS data", f"CAST(id % {PARTITIONS} AS INT) AS partition"
    )
    df.cache().count()  # the rows exist before the clock starts: only the write is timed
    before = cpu_seconds(cluster)
    t0 = time.perf_counter()
    df.write.format("waltz").options(**cluster.options).mode("append").save()
    elapsed = time.perf_counter() - t0
    after = cpu_seconds(cluster)
    df.unpersist()
    return elapsed, {k: after[k] - before[k] for k in after}


async def log_size(options: dict[str, str]) -> int:
    async with LogReader(parse_options(options).client_config) as reader:
        return sum([await reader.high_water_mark(p) + 1 for p in range(PARTITIONS)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with waltz_cluster("waltz-spark-write-bench-") as cluster:
        with spark_session() as spark:
            load = os.getloadavg()[0]
            writes = [spark_write(spark, cluster, args.rows, args.size) for _ in range(args.runs + 1)]
        written = asyncio.run(log_size(cluster.options))
    expected = args.rows * (args.runs + 1)
    if written != expected:
        raise SystemExit(f"the log holds {written:,} transactions, {expected:,} were written")
    warm = writes[1:]
    seconds = [w[0] for w in warm]
    spark_cpu = median([w[1]["spark"] for w in warm])
    cluster_cpu = median([w[1]["cluster"] for w in warm])
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; every row is in the log ({written:,})")
    print("| write | rows | seconds | rows/s |")
    print("|---|---:|---:|---:|")
    first = writes[0][0]
    print(f"| first (cold workers) | {args.rows:,} | {first:.2f} | {args.rows / first:,.0f} |")
    for name, s in (("best", min(seconds)), ("median", median(seconds))):
        print(f"| {name} of {args.runs} warm | {args.rows:,} | {s:.2f} | {args.rows / s:,.0f} |")
    print(
        f"CPU per warm write (median): Spark {spark_cpu:.2f} s ({spark_cpu / args.rows * 1e6:.0f} µs/row), "
        f"server + storage {cluster_cpu:.2f} s ({cluster_cpu / args.rows * 1e6:.0f} µs/row)"
    )


if __name__ == "__main__":
    main()
