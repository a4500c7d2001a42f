"""Batch read throughput of the Spark ``waltz`` source beside Parquet of the same rows and the plain client.

Starts a local cluster (``spark_bench.waltz_cluster``: ZooKeeper, one storage node, one server, two
partitions), appends ``--transactions`` transactions of ``--size`` bytes through the client (each its own
random payload, as a real log holds; ``--repeated`` puts one payload in all of them, the bench's data before
session 8, which Parquet's dictionary encoding stores once), then times:

* ``LogReader.read_range``: one process reading both partitions with range requests of 10,000, one at a time,
  into ``Record`` objects (checksums verified);
* the Spark tasks' reader (``waltz.spark.cluster``, ``LogReader.read_run`` with three requests in flight)
  in one plain process, turning each run into an Arrow batch as a task does (``waltz.spark.arrow.to_arrow``,
  checksums verified);
* for each of ``--sizes`` (the first N transactions, half from each partition, through ``endingOffsets``):
  Spark ``local[2]`` reading them with ``spark.read.format("waltz")``, aggregated so every row and byte is
  materialised (``count(*)``, ``sum(length(data))``), and the **same rows from Parquet** (written once per
  size from the waltz DataFrame, two files like the two partitions) with the same aggregation.
  ``--warmup`` runs of each (default 1) warm up (the first waltz query of the session also starts the Python
  workers), then ``--runs`` runs of each are interleaved so both see the same machine load; the
  waltz/Parquet ratio of the medians is printed (goal >= 50%), with the CPU seconds per query of the Spark
  processes (JVM and Python workers) and of the cluster (server and storage node). With ``--schema-row``, a
  third read of the same rows with a user-specified schema of the one column the aggregation needs
  (``.schema("data BINARY")``, column pruning the user asks for) is timed too, as its own row: the headline
  ratio reads the default schema.
  With ``--floor``, a fourth read of the same rows goes through a minimal Python data source that does no
  I/O at all (``waltz_floor``: each task yields, from a cache built once per worker, Arrow batches with the
  waltz source's schema, rows of the same sizes and the same number of rows per batch and per task), the
  floor of PySpark's Python data-source API: no Python source can read these rows faster.

CPU per query is split into the JVM (with its executor task threads, which read the workers' Arrow streams,
and its JIT compiler threads), the Python workers, and the server + storage node.

Parquet reads only the ``data`` column (column pruning, a vectorised reader in the JVM); the Python source
ships every column through a Python worker and Arrow (PySpark 4.3 has no column pruning for Python sources).

Usage: ``.venv/bin/python bench/spark_read.py [--sizes 100000,400000] [--size 512] [--runs 5] [--schema-row]
[--floor] [--repeated]``
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import os
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from spark_bench import PARTITIONS, BenchCluster, cpu_seconds, median, spark_session, waltz_cluster
from waltz.client.reader import LogReader
from waltz.spark.arrow import READ_SCHEMA_DDL, arrow_schema, to_arrow
from waltz.spark.cluster import close_all, open_source
from waltz.spark.options import parse_options
from waltz.spark.writer import RowWriter

FLOOR_FORMAT = "waltz_floor"
REQ_ID_BYTES = 16
FETCH_ROWS = 10_000  # rows per Arrow batch of the waltz source (one record run: fetchSize's default)


# The floor source. Its classes live in this script (``__main__``), so PySpark pickles them by value into the
# workers; they must not reference ``spark_bench`` (not importable there). The batch cache lives in a module
# of its own in ``sys.modules``, because every task unpickles a fresh copy of this script's globals.


def floor_batch(partition: int, rows: int, size: int, distinct: bool) -> Any:
    """A batch of ``rows`` rows with the waltz source's schema: ``size`` bytes of data and a 16-byte reqId
    per row (the same in every row, or ``distinct`` random bytes per row), built once per worker process
    and cached."""
    cache_module = sys.modules.get("_waltz_bench_floor")
    if cache_module is None:
        cache_module = types.ModuleType("_waltz_bench_floor")
        cache_module.cache = {}  # type: ignore[attr-defined]
        sys.modules["_waltz_bench_floor"] = cache_module
    cache: dict[tuple[int, int, int, bool], Any] = cache_module.cache  # type: ignore[attr-defined]
    key = (partition, rows, size, distinct)
    if key not in cache:

        def binary(width: int) -> Any:
            offsets = array.array("i", range(0, (rows + 1) * width, width))
            values = os.urandom(width * rows) if distinct else os.urandom(width) * rows
            return pa.Array.from_buffers(
                pa.binary(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(values)]
            )

        cache[key] = pa.RecordBatch.from_arrays(
            [
                pa.repeat(pa.scalar(partition, pa.int32()), rows),
                pa.array(range(rows), pa.int64()),
                pa.array([0] * rows, pa.int32()),
                binary(REQ_ID_BYTES),
                binary(size),
            ],
            schema=arrow_schema(True),
        )
    return cache[key]


class FloorReader(DataSourceReader):
    def __init__(self, rows: int, partitions: int, size: int, distinct: bool, names: list[str]) -> None:
        self.rows, self.parts, self.size, self.distinct, self.names = rows, partitions, size, distinct, names

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(p) for p in range(self.parts)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        p = partition.value
        batch = floor_batch(p, FETCH_ROWS, self.size, self.distinct).select(self.names)
        left = self.rows // self.parts
        while left > 0:
            yield batch if left >= FETCH_ROWS else batch.slice(0, left)
            left -= FETCH_ROWS


class FloorDataSource(DataSource):
    """``waltz_floor``: the rows of a waltz read (options ``rows``, ``partitions``, ``size``, ``distinct``)
    without I/O."""

    @classmethod
    def name(cls) -> str:
        return FLOOR_FORMAT

    def schema(self) -> str:
        return READ_SCHEMA_DDL

    def reader(self, schema: Any) -> FloorReader:
        opts = self.options
        names = [f.name for f in schema.fields]
        distinct = opts["distinct"] == "true"
        return FloorReader(int(opts["rows"]), int(opts["partitions"]), int(opts["size"]), distinct, names)


def append(options: dict[str, str], count: int, size: int, distinct: bool) -> None:
    payload = os.urandom(size)
    writer = RowWriter(parse_options({**options, "waltz.client.maxConcurrentTransactions": "500"}))
    chunk = 50_000
    for first in range(0, count, chunk):
        rows = (
            {"partition": i % PARTITIONS, "data": os.urandom(size) if distinct else payload}
            for i in range(first, min(count, first + chunk))
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


def task_read(options: dict[str, str]) -> tuple[int, int, float]:
    source = open_source(parse_options(options))  # what each Spark task uses, here in one plain process
    hwms = source.high_water_marks(range(PARTITIONS))
    t0 = time.perf_counter()
    rows = nbytes = 0
    for p in range(PARTITIONS):
        for run in source.read(p, 0, hwms[p] + 1):
            batch = to_arrow(p, run)
            rows += batch.num_rows
            nbytes += batch.column(4).buffers()[2].size
    elapsed = time.perf_counter() - t0
    close_all()
    return rows, nbytes, elapsed


def aggregate(df: Any) -> tuple[int, int]:
    from pyspark.sql import functions as sf

    row = df.agg(sf.count("*").alias("n"), sf.sum(sf.length("data")).alias("b")).collect()[0]
    return int(row.n), int(row.b)


def ending(count: int) -> str:
    return json.dumps({str(p): count // PARTITIONS for p in range(PARTITIONS)})


def line(name: str, rows: int, nbytes: int, seconds: float) -> str:
    return f"| {name} | {rows:,} | {seconds:.2f} | {rows / seconds:,.0f} | {nbytes / seconds / 1e6:,.1f} |"


USER_SCHEMA = "data BINARY"
SCHEMA_ROW = f"waltz, user schema `{USER_SCHEMA}`"


FLOOR_ROW = "floor: Python source without I/O"


def floor_source_options(count: int, args: argparse.Namespace) -> dict[str, str]:
    return {
        "rows": str(count),
        "partitions": str(PARTITIONS),
        "size": str(args.size),
        "distinct": "true" if args.distinct else "false",
    }


def measure(
    cluster: BenchCluster, count: int, reads: dict[str, Any], args: argparse.Namespace
) -> tuple[dict[str, list[float]], list[str]]:
    """Runs ``reads`` interleaved (``--warmup`` untimed rounds, then ``--runs`` timed ones); the seconds of
    each timed run and a result table row per read."""
    seconds: dict[str, list[float]] = {name: [] for name in reads}
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name in reads}
    for attempt in range(args.runs + args.warmup):
        for name, read in reads.items():
            before = cpu_seconds(cluster)
            t0 = time.perf_counter()
            rows, _ = read()
            elapsed = time.perf_counter() - t0
            after = cpu_seconds(cluster)
            if rows != count:
                raise SystemExit(f"{name} read {rows:,} rows, expected {count:,}")
            if attempt >= args.warmup:  # the first runs of each warm up (JVM JIT, Python workers)
                seconds[name].append(elapsed)
                cpu[name].append({k: after[k] - before[k] for k in after})
    out = []
    for name in reads:
        best, mid = min(seconds[name]), median(seconds[name])

        def mid_cpu(key: str, name: str = name) -> float:
            return median([c[key] for c in cpu[name]])

        out.append(
            f"| {name} | {count:,} | {best:.2f} / {mid:.2f} | {count / best:,.0f} / {count / mid:,.0f} | "
            f"{mid_cpu('jvm'):.2f} ({mid_cpu('jvm_tasks'):.2f}, {mid_cpu('jvm_jit'):.2f}) | "
            f"{mid_cpu('workers'):.2f} | {mid_cpu('cluster'):.2f} |"
        )
    return seconds, out


def compare_floor(spark: Any, cluster: BenchCluster, count: int, args: argparse.Namespace) -> list[str]:
    """The floor source against Parquet of its own rows (written once from it), for sizes beyond the log."""
    floor_options = floor_source_options(count, args)
    parquet_dir = cluster.directory / f"parquet-floor-{count}"
    floor_df = spark.read.format(FLOOR_FORMAT).options(**floor_options).load()
    floor_df.coalesce(PARTITIONS).write.parquet(str(parquet_dir))
    reads = {
        FLOOR_ROW: lambda: aggregate(spark.read.format(FLOOR_FORMAT).options(**floor_options).load()),
        "parquet": lambda: aggregate(spark.read.parquet(str(parquet_dir))),
    }
    seconds, out = measure(cluster, count, reads, args)
    ratio = median(seconds["parquet"]) / median(seconds[FLOOR_ROW])
    out.append(f"| **floor / Parquet rate (medians)** | {count:,} | | **{ratio:.0%}** | | | |")
    return out


def compare(
    spark: Any,
    cluster: BenchCluster,
    count: int,
    args: argparse.Namespace,
) -> list[str]:
    """Interleaved waltz and Parquet reads (and the floor's) of the first ``count`` transactions; the rows
    of the result table."""
    options = {**cluster.options, "endingOffsets": ending(count)}
    parquet_dir = cluster.directory / f"parquet-{count}"
    spark.read.format("waltz").options(**options).load().coalesce(PARTITIONS).write.parquet(str(parquet_dir))
    floor_options = floor_source_options(count, args)

    def waltz() -> tuple[int, int]:
        return aggregate(spark.read.format("waltz").options(**options).load())

    def parquet() -> tuple[int, int]:
        return aggregate(spark.read.parquet(str(parquet_dir)))

    def waltz_schema() -> tuple[int, int]:
        # Column pruning the user asks for (a schema of the columns the query needs): a separate row, not
        # the headline comparison, which reads the source's default schema.
        return aggregate(spark.read.format("waltz").schema(USER_SCHEMA).options(**options).load())

    def floor() -> tuple[int, int]:
        return aggregate(spark.read.format(FLOOR_FORMAT).options(**floor_options).load())

    reads = {"waltz": waltz, "parquet": parquet}
    if args.schema_row:
        reads[SCHEMA_ROW] = waltz_schema
    if args.floor:
        reads[FLOOR_ROW] = floor
    seconds, out = measure(cluster, count, reads, args)

    def ratio(name: str) -> str:
        return f"{median(seconds['parquet']) / median(seconds[name]):.0%}"

    out.append(
        f"| **waltz / Parquet rate (medians)** | {count:,} | | **{ratio('waltz')}** (goal >= 50%) | | | |"
    )
    if args.schema_row:
        out.append(f"| {SCHEMA_ROW} / Parquet rate (medians) | {count:,} | | {ratio(SCHEMA_ROW)} | | | |")
    if args.floor:
        out.append(f"| **floor / Parquet rate (medians)** | {count:,} | | **{ratio(FLOOR_ROW)}** | | | |")
        share = median(seconds[FLOOR_ROW]) / median(seconds["waltz"])
        out.append(f"| waltz / floor rate (medians) | {count:,} | | {share:.0%} | | | |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,400000", help="comma-separated transaction counts to read")
    parser.add_argument("--size", type=int, default=512, help="bytes of data per transaction")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed runs of each read per size before the timed ones (the JVM keeps compiling the query "
        "paths for ~10 queries: more warm-up gives steadier, lower figures for both)",
    )
    parser.add_argument(
        "--schema-row",
        action="store_true",
        help=f"also time the waltz read with a user-specified schema ({USER_SCHEMA!r}: the only column the "
        "aggregation needs), as a separate row",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help=f"also time a minimal Python data source without I/O ({FLOOR_FORMAT!r}) reading rows of the "
        "same schema, sizes and batches: the floor of PySpark's Python data-source API",
    )
    parser.add_argument(
        "--floor-sizes",
        default="",
        help="comma-separated row counts beyond the log for which only the floor source and Parquet of its "
        "own rows are timed (how the floor's ratio moves with size)",
    )
    payload = parser.add_mutually_exclusive_group()
    payload.add_argument(
        "--distinct",
        action="store_true",
        help="a random payload per transaction, as a real log holds (the default since session 8)",
    )
    payload.add_argument(
        "--repeated",
        action="store_true",
        help="one payload repeated in every transaction (the default before session 8), which Parquet's "
        "dictionary encoding stores once: a 400,000-row file of ~25 KB instead of ~200 MB",
    )
    args = parser.parse_args()
    args.distinct = not args.repeated
    sizes = [int(s) for s in args.sizes.split(",")]
    total = max(sizes)
    with waltz_cluster("waltz-spark-bench-") as cluster:
        t0 = time.perf_counter()
        append(cluster.options, total, args.size, args.distinct)
        print(f"appended {total:,} x {args.size} B in {time.perf_counter() - t0:.1f} s", flush=True)
        load = [os.getloadavg()[0]]
        plain = asyncio.run(plain_read(cluster.options))
        tasks = task_read(cluster.options)
        single = [
            line("plain LogReader.read_range, records (1 process)", *plain),
            line("LogReader.read_run into Arrow batches, 3 in flight (1 process)", *tasks),
        ]
        with spark_session() as spark:
            spark.dataSource.register(FloorDataSource)
            tables = [compare(spark, cluster, count, args) for count in sizes]
            floor_sizes = [int(s) for s in args.floor_sizes.split(",") if s]
            tables.extend(compare_floor(spark, cluster, count, args) for count in floor_sizes)
        load.append(os.getloadavg()[0])
    print(f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    print("| reader | transactions | seconds | transactions/s | MB/s |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(single))
    print()
    print(
        f"| Spark local[2] | transactions | seconds, best / median of {args.runs} | transactions/s, best / "
        "median | CPU s per query: JVM (executor task threads, JIT) | Python workers | server + storage |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(row for table in tables for row in table))


if __name__ == "__main__":
    main()
