"""Batch read throughput of the Spark ``waltz`` source beside the plain client (LogReader) on the same range.

Starts a local cluster (``waltz local``: ZooKeeper, one storage node, one server, two partitions) in a
temporary directory, appends ``--transactions`` transactions of ``--size`` bytes through the client, then
times, over the same committed range:

* ``LogReader.read_range``: one process reading both partitions with range requests of 10,000, one at a time,
  into ``Record`` objects (checksums verified);
* the Spark tasks' reader (``waltz.spark.cluster``, ``LogReader.read_run`` with three requests in flight)
  in one plain process, unpacking each run into columns (``RecordRun.columns``, checksums verified);
* Spark ``local[2]``: ``spark.read.format("waltz")...`` aggregated so every row and byte is materialised
  (``count(*)``, ``sum(length(data))``). The first Spark run pays the Python worker start-up; the best and
  the median of the following ``--runs`` runs are reported, as is the first;
* Spark ``local[2]`` reading the **same rows from Parquet** (written once from the waltz DataFrame, in two
  files like the two waltz partitions) with the same aggregation, the runs interleaved with the waltz runs
  so both see the same machine load; the waltz/Parquet ratio of the medians is printed (goal >= 50%).
  Parquet reads only the ``data`` column (column pruning), the Python source every column (PySpark 4.3 has
  no column pruning for Python sources).

Usage: ``.venv/bin/python bench/spark_read.py [--transactions 400000] [--size 512] [--runs 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from waltz.client.reader import LogReader
from waltz.local import UpOptions, down, up
from waltz.spark.cluster import close_all, open_source
from waltz.spark.options import parse_options
from waltz.spark.writer import RowWriter

PARTITIONS = 2


def append(options: dict[str, str], count: int, size: int) -> None:
    payload = os.urandom(size)
    writer = RowWriter(parse_options({**options, "waltz.client.maxConcurrentTransactions": "500"}))
    chunk = 50_000
    for first in range(0, count, chunk):
        rows = (
            {"partition": i % PARTITIONS, "data": payload} for i in range(first, min(count, first + chunk))
        )
        writer.append_rows(rows)


async def plain_read(options: dict[str, str]) -> tuple[int, int, float]:
    config = parse_options(options).client_config
    async with LogReader(config) as reader:
        hwms = [await reader.high_water_mark(p) for p in range(PARTITIONS)]
        t0 = time.perf_counter()
        rows = nbytes = 0
        for p in range(PARTITIONS):
            pos = 0
            while pos <= hwms[p]:
                batch = await reader.read_range(p, pos, min(10_000, hwms[p] - pos + 1))
                rows += len(batch)
                nbytes += sum(len(r.data) for r in batch)
                pos += len(batch)
        return rows, nbytes, time.perf_counter() - t0


def columnar_read(options: dict[str, str]) -> tuple[int, int, float]:
    source = open_source(parse_options(options))  # what each Spark task uses, here in one plain process
    hwms = source.high_water_marks(range(PARTITIONS))
    t0 = time.perf_counter()
    rows = nbytes = 0
    for p in range(PARTITIONS):
        for run in source.read(p, 0, hwms[p] + 1):
            cols = run.columns()
            rows += cols.num_records
            nbytes += len(cols.data)
    elapsed = time.perf_counter() - t0
    close_all()
    return rows, nbytes, elapsed


def spark_read(spark: object, options: dict[str, str]) -> tuple[int, int, float]:
    from pyspark.sql import functions as sf

    t0 = time.perf_counter()
    df = spark.read.format("waltz").options(**options).load()  # type: ignore[attr-defined]
    row = df.agg(sf.count("*").alias("n"), sf.sum(sf.length("data")).alias("b")).collect()[0]
    return int(row.n), int(row.b), time.perf_counter() - t0


def parquet_read(spark: object, path: Path) -> tuple[int, int, float]:
    from pyspark.sql import functions as sf

    t0 = time.perf_counter()
    df = spark.read.parquet(str(path))  # type: ignore[attr-defined]
    row = df.agg(sf.count("*").alias("n"), sf.sum(sf.length("data")).alias("b")).collect()[0]
    return int(row.n), int(row.b), time.perf_counter() - t0


def line(name: str, rows: int, nbytes: int, seconds: float) -> str:
    return f"| {name} | {rows:,} | {seconds:.2f} | {rows / seconds:,.0f} | {nbytes / seconds / 1e6:,.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=400_000)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    directory = Path(tempfile.mkdtemp(prefix="waltz-spark-bench-"))
    cluster = up(UpOptions(directory=directory, storages=1, servers=1, partitions=PARTITIONS))
    try:
        options = {
            "waltz.zookeeper.connectString": cluster.zk_connect,
            "waltz.cluster.root": cluster.cluster_root,
        }
        t0 = time.perf_counter()
        append(options, args.transactions, args.size)
        print(
            f"appended {args.transactions:,} x {args.size} B in {time.perf_counter() - t0:.1f} s", flush=True
        )
        results = [
            line("plain LogReader.read_range, records (1 process)", *asyncio.run(plain_read(options))),
            line("LogReader.read_run, columns, 3 in flight (1 process)", *columnar_read(options)),
        ]
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
        runs = [spark_read(spark, options)]
        parquet_dir = directory / "parquet"
        spark.read.format("waltz").options(**options).load().coalesce(PARTITIONS).write.parquet(
            str(parquet_dir)
        )
        parquet_runs = [parquet_read(spark, parquet_dir)]  # the first Parquet read warms its code paths
        for _ in range(args.runs):
            runs.append(spark_read(spark, options))
            parquet_runs.append(parquet_read(spark, parquet_dir))
        results.append(line("Spark local[2], first run (cold workers)", *runs[0]))
        warm = sorted(runs[1:], key=lambda r: r[2])
        results.append(line(f"Spark local[2], best of {args.runs} warm runs", *warm[0]))
        results.append(line(f"Spark local[2], median of {args.runs} warm runs", *warm[len(warm) // 2]))
        parquet = sorted(parquet_runs[1:], key=lambda r: r[2])
        results.append(line(f"Spark local[2], Parquet of the same rows, best of {args.runs}", *parquet[0]))
        results.append(line(f"Spark local[2], Parquet, median of {args.runs}", *parquet[len(parquet) // 2]))
        spark.stop()
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
        print("| reader | transactions | seconds | transactions/s | MB/s |")
        print("|---|---:|---:|---:|---:|")
        print("\n".join(results))
        ratio = parquet[len(parquet) // 2][2] / warm[len(warm) // 2][2]
        print(f"waltz warm median / Parquet warm median (rate): {ratio:.0%} (goal >= 50%)")
    finally:
        down(directory, purge=True)


if __name__ == "__main__":
    main()
