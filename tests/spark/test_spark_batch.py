"""Batch reads and writes of the ``waltz`` format against a real local cluster."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.spark.conftest import NUM_PARTITIONS, WaltzTestCluster

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.timeout(240)]


def log_rows(cluster: WaltzTestCluster) -> list[tuple[int, int, int, bytes, bytes]]:
    return [
        (p, r.transaction_id, r.header, r.req_id.to_bytes(), r.data)
        for p in range(NUM_PARTITIONS)
        for r in cluster.read_all(p)
    ]


def test_batch_read_equals_the_log(spark: Any, waltz_cluster: WaltzTestCluster) -> None:
    tag = uuid.uuid4().hex[:8].encode()
    waltz_cluster.append(
        [
            # Negative and extreme headers must survive (P6); payloads of varied sizes, some empty.
            {"partition": i % NUM_PARTITIONS, "header": (i * 7919) - 2**31 + 1, "data": tag + bytes(i % 700)}
            for i in range(400)
        ]
    )
    df = spark.read.format("waltz").options(**waltz_cluster.options).option("minPartitions", "5").load()
    assert df.schema.simpleString() == (
        "struct<partition:int,transactionId:bigint,header:int,reqId:binary,data:binary>"
    )
    rows = [(r.partition, r.transactionId, r.header, bytes(r.reqId), bytes(r.data)) for r in df.collect()]
    expected = log_rows(waltz_cluster)
    assert len(rows) == len(set(rows)) == len(expected)  # every transaction exactly once
    assert sorted(rows) == sorted(expected)  # data, headers and request ids intact
    assert df.rdd.getNumPartitions() >= 5
    # Small range requests, many in flight, over records that cross segment ends (trimmed runs): same rows.
    small = (
        spark.read.format("waltz")
        .options(**waltz_cluster.options)
        .option("fetchSize", "7")
        .option("fetchDepth", "5")
        .load()
    )
    assert sorted(
        (r.partition, r.transactionId, r.header, bytes(r.reqId), bytes(r.data)) for r in small.collect()
    ) == sorted(expected)
    # The DataFrame is a snapshot: appends after its first action do not change it (PYSPARK.md §2.3).
    waltz_cluster.append([{"partition": 0, "data": b"later"}])
    assert df.count() == len(expected)


def test_partition_and_offset_options_prune_the_read(spark: Any, waltz_cluster: WaltzTestCluster) -> None:
    waltz_cluster.append([{"partition": 1, "data": b"p1-%d" % i} for i in range(20)])
    hwm = waltz_cluster.hwms()[1]

    def reader() -> Any:  # DataFrameReader.option mutates the reader: take a fresh one each time
        return spark.read.format("waltz").options(**waltz_cluster.options)

    df = (
        reader()
        .option("partitions", "1")
        .option("startingOffsets", '{"1": 2}')
        .option("endingOffsets", '{"1": 12}')
        .option("maxRecordsPerPartition", "4")
        .option("includeData", "false")
        .load()
    )
    assert "data" not in df.columns
    got = sorted((r.partition, r.transactionId) for r in df.collect())
    assert got == [(1, i) for i in range(2, 12)]
    assert df.rdd.getNumPartitions() == 3  # 10 transactions, at most 4 per task
    tail = reader().option("partitions", "1").option("startingOffsets", f'{{"1": {hwm - 2}}}').load()
    assert sorted(r.transactionId for r in tail.collect()) == [hwm - 2, hwm - 1, hwm]


def test_a_user_schema_reads_only_its_columns(spark: Any, waltz_cluster: WaltzTestCluster) -> None:
    """``.schema(...)`` with a subset of the columns, in another order: the tasks build and ship only those
    (column pruning the user asks for; PySpark 4.3 does none for Python sources)."""
    waltz_cluster.append(
        [{"partition": i % NUM_PARTITIONS, "header": i, "data": b"u%d" % i} for i in range(30)]
    )
    expected = sorted((bytes(d), t) for p, t, _, _, d in log_rows(waltz_cluster))
    df = (
        spark.read.format("waltz")
        .schema("data BINARY, transactionId BIGINT")
        .options(**waltz_cluster.options)
        .load()
    )
    assert df.columns == ["data", "transactionId"]
    assert sorted((bytes(r.data), r.transactionId) for r in df.collect()) == expected
    assert df.selectExpr("sum(length(data))").collect()[0][0] == sum(len(d) for d, _ in expected)
    bad = spark.read.format("waltz").schema("data STRING, offset BIGINT").options(**waltz_cluster.options)
    with pytest.raises(Exception, match=r"column 'data' is BINARY, not STRING.*'offset' is not a column"):
        bad.load().collect()


def test_bad_options_are_rejected_when_the_source_is_built(
    spark: Any, waltz_cluster: WaltzTestCluster
) -> None:
    def reader() -> Any:
        return spark.read.format("waltz").options(**waltz_cluster.options)

    with pytest.raises(
        Exception, match=r"unknown option 'startingoffset' \(did you mean startingOffsets\?\)"
    ):
        reader().option("startingOffset", "earliest").load()
    with pytest.raises(Exception, match="maxOffsetsPerTrigger"):
        reader().option("maxOffsetsPerTrigger", "10").load().collect()
    with pytest.raises(Exception, match="partitions \\[7\\] do not exist"):
        reader().option("partitions", "7").load().collect()
    with pytest.raises(Exception, match="endingOffsets 99999 is past the committed log"):
        reader().option("endingOffsets", '{"0": 99999}').load().collect()
    stream = spark.readStream.format("waltz").options(**waltz_cluster.options)
    query = stream.option("endingOffsets", "latest").load().writeStream.format("noop").start()
    with pytest.raises(Exception, match="endingOffsets \\(batch only\\)"):
        query.awaitTermination(120)  # streaming sources are built on the query's own thread


def test_writes_are_read_back(spark: Any, waltz_cluster: WaltzTestCluster) -> None:
    tag = uuid.uuid4().hex.encode()
    rows = [(bytearray(tag + b"-%d" % i), i % NUM_PARTITIONS, -i) for i in range(60)]
    df = spark.createDataFrame(rows, "data BINARY, partition INT, header INT").repartition(2)
    df.write.format("waltz").options(**waltz_cluster.options).mode("append").save()
    written = [(p, h, d) for p, _, h, _, d in log_rows(waltz_cluster) if d.startswith(tag)]
    assert sorted(written) == sorted((p, h, bytes(d)) for d, p, h in rows)  # each row exactly once
    # Unknown columns and a missing data column are refused before anything is appended.
    bad = spark.createDataFrame([(b"x", 1)], "data BINARY, account INT")
    with pytest.raises(Exception, match="unknown column 'account'"):
        bad.write.format("waltz").options(**waltz_cluster.options).mode("append").save()
