"""Structured Streaming reads of the ``waltz`` format: restart from a checkpoint, a live cluster, the sink."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.spark.conftest import NUM_PARTITIONS, WaltzTestCluster
from waltz.spark.options import parse_options
from waltz.spark.plan import progress_lag
from waltz.spark.writer import MARKER_HEADER, exactly_once_commit

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.timeout(300)]


def now_offsets(cluster: WaltzTestCluster) -> str:
    """startingOffsets at the current end of every partition, so a test sees only its own rows."""
    return json.dumps({str(p): hwm + 1 for p, hwm in cluster.hwms().items()})


def test_stream_killed_mid_batch_restarts_exactly_once(
    spark: Any, waltz_cluster: WaltzTestCluster, tmp_path: Path
) -> None:
    start = now_offsets(waltz_cluster)
    tag = uuid.uuid4().hex[:8]
    first = [{"partition": i % NUM_PARTITIONS, "data": f"{tag}-{i}".encode()} for i in range(45)]
    waltz_cluster.append(first)
    out = tmp_path / "out"
    failed_once = threading.Event()

    def sink(batch: Any, batch_id: int) -> None:
        # Idempotent by batch id (overwrite), like a file or Delta sink.
        batch.write.mode("overwrite").parquet(str(out / f"batch={batch_id}"))
        if batch_id == 2 and not failed_once.is_set():
            failed_once.set()
            raise RuntimeError("killed after writing part of batch 2")  # offsets/2 written, commits/2 not

    def run() -> Any:
        stream = (
            spark.readStream.format("waltz")
            .options(**waltz_cluster.options)
            .option("startingOffsets", start)
            .option("maxOffsetsPerTrigger", "10")
            .load()
        )
        return (
            stream.writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )

    query = run()
    with pytest.raises(Exception, match="killed after writing part of batch 2"):
        query.awaitTermination(120)
    second = [{"partition": i % NUM_PARTITIONS, "data": f"{tag}-{i}".encode()} for i in range(45, 60)]
    waltz_cluster.append(second)
    query = run()
    assert query.awaitTermination(120)
    assert query.exception() is None
    got = [bytes(r.data).decode() for r in spark.read.parquet(str(out)).collect()]
    assert sorted(got) == sorted(f"{tag}-{i}" for i in range(60))  # all 60, none twice
    assert all(p["numInputRows"] <= 10 for p in query.recentProgress)
    offsets = (tmp_path / "checkpoint" / "offsets" / "0").read_text().splitlines()[-1]
    parsed = json.loads(offsets)
    assert parsed["v"] == 2
    assert list(parsed["partitions"]) == [str(p) for p in range(NUM_PARTITIONS)]


def test_stream_follows_a_live_cluster(spark: Any, waltz_cluster: WaltzTestCluster, tmp_path: Path) -> None:
    start = now_offsets(waltz_cluster)
    tag = uuid.uuid4().hex[:8]
    name = f"live_{tag}"
    query = (
        spark.readStream.format("waltz")
        .options(**waltz_cluster.options)
        .option("startingOffsets", start)
        .load()
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="500 milliseconds")
        .start()
    )
    try:
        total = 0
        for round_ in range(5):  # appends continue while the query runs
            rows = [
                {"partition": i % NUM_PARTITIONS, "data": f"{tag}-{round_}-{i}".encode()} for i in range(20)
            ]
            waltz_cluster.append(rows)
            total += len(rows)
            time.sleep(0.3)
        deadline = time.monotonic() + 120
        seen = 0
        while time.monotonic() < deadline:
            seen = spark.sql(f"SELECT count(*) AS n FROM {name}").collect()[0].n
            if seen >= total:
                break
            time.sleep(0.5)
        rows = spark.sql(f"SELECT partition, transactionId, data FROM {name}").collect()
        assert len(rows) == total
        assert len({(r.partition, r.transactionId) for r in rows}) == total
        assert {bytes(r.data).decode() for r in rows} == {
            f"{tag}-{k}-{i}" for k in range(5) for i in range(20)
        }
        assert query.lastProgress["sources"][0]["latestOffset"] is not None
    finally:
        query.stop()


def test_exactly_once_sink_skips_replayed_batches(waltz_cluster: WaltzTestCluster) -> None:
    tag = uuid.uuid4().hex[:8]
    CK = f"spark-query:{tag}"  # noqa: N806 - the checkpoint identity, a constant of this test
    query_id = f"q-{tag}"
    options = parse_options({**waltz_cluster.options, "exactlyOnce": "true", "queryId": query_id})
    rows = [(i % NUM_PARTITIONS, i, f"{tag}-{i}".encode(), (), (), ()) for i in range(12)]

    def ours() -> list[tuple[int, int, bytes]]:
        return [
            (p, r.header, r.data)
            for p in range(NUM_PARTITIONS)
            for r in waltz_cluster.read_all(p)
            if r.data.startswith(tag.encode()) and r.header != MARKER_HEADER
        ]

    assert exactly_once_commit(options, 0, rows, CK) == 12
    assert exactly_once_commit(options, 0, rows, CK) == 0  # a replay of batch 0 appends nothing
    assert sorted(ours()) == sorted((p, h, d) for p, h, d, *_ in rows)
    # An attempt that died after appending a prefix: the replay appends only the rest.
    partial = rows[:5]
    from waltz.spark import writer

    real_marker = writer._marker
    calls = {"n": 0}

    def die_at_end(kind: str, *args: Any) -> Any:
        if kind == "end":
            calls["n"] += 1
            raise RuntimeError("driver died before END")
        return real_marker(kind, *args)

    writer._marker = die_at_end  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="before END"):
            exactly_once_commit(options, 1, partial, CK)
    finally:
        writer._marker = real_marker  # type: ignore[assignment]
    batch1 = [(p, h + 100, d + b"-b1", *rest) for p, h, d, *rest in rows]
    assert exactly_once_commit(options, 2, batch1, CK) == 12
    assert calls["n"] == 1
    # Batch 1's first attempt died after appending its first five rows (the driver only had those when it
    # died); the replay with the whole batch recognises them by the attempt's client id and appends 7.
    assert exactly_once_commit(options, 1, rows, CK) == 7
    assert exactly_once_commit(options, 1, rows, CK) == 0
    counted = sorted(ours())
    assert len(counted) == 12 + 12 + 12  # batch 0, batch 1 (5 + 7), batch 2: each row once


def test_progress_reports_the_lag_per_partition(
    spark: Any, waltz_cluster: WaltzTestCluster, tmp_path: Path
) -> None:
    start = now_offsets(waltz_cluster)
    waltz_cluster.append([{"partition": i % 2, "data": b"lag-%d" % i} for i in range(30)])  # 15 + 15
    query = (
        spark.readStream.format("waltz")
        .options(**waltz_cluster.options)
        .option("startingOffsets", start)
        .option("maxOffsetsPerTrigger", "10")
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120)
    lags = [progress_lag(p) for p in query.recentProgress]
    # Transactions committed but not yet in a micro-batch, after each batch of 10 was planned.
    assert [lag["total"] for lag in lags if lag is not None] == [20, 10, 0]
    first = lags[0]
    assert first is not None
    assert first["partitions"] == {0: 10, 1: 10, 2: 0}
