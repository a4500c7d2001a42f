"""The ``waltz`` streaming sink with a checkpoint, and write planning (issue 12, items 1, 4 and 7)."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.spark.conftest import NUM_PARTITIONS, WaltzTestCluster
from waltz.spark.writer import MARKER_HEADER

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.timeout(300)]


def write_input(directory: Path, name: str, values: list[str]) -> None:
    """One JSON-lines file of the file source, written whole then renamed (the file source may list it)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.tmp"
    tmp.write_text("".join(json.dumps({"value": v}) + "\n" for v in values))
    tmp.rename(directory / f"{name}.json")


def sink_query(spark: Any, cluster: WaltzTestCluster, source: Path, checkpoint: Path, **extra: str) -> Any:
    """A file source (replayable) into the waltz sink, on ``checkpoint``, one file per micro-batch."""
    rows = (
        spark.readStream.schema("value STRING")
        .option("maxFilesPerTrigger", "1")
        .json(str(source))
        .selectExpr("CAST(value AS BINARY) AS data", f"CAST(hash(value) % {NUM_PARTITIONS} AS INT) AS p")
        .selectExpr("data", "abs(p) AS partition")
    )
    return (
        rows.writeStream.format("waltz")
        .options(**cluster.options)
        .options(**extra)
        .option("checkpointLocation", str(checkpoint))  # Spark's own options pass through the sink
        .queryName(f"sink_{uuid.uuid4().hex[:8]}")
        .trigger(availableNow=True)
        .start()
    )


def appended(cluster: WaltzTestCluster, tag: str) -> Counter[str]:
    """How many times each of this test's values is in the log (markers left out)."""
    return Counter(
        r.data.decode()
        for p in range(NUM_PARTITIONS)
        for r in cluster.read_all(p)
        if r.header != MARKER_HEADER and r.data.startswith(tag.encode())
    )


@pytest.mark.parametrize("exactly_once", [True, False], ids=["exactlyOnce", "default"])
def test_sink_stopped_and_restarted_on_its_checkpoint_appends_every_row(
    spark: Any, waltz_cluster: WaltzTestCluster, tmp_path: Path, exactly_once: bool
) -> None:
    tag = uuid.uuid4().hex[:8]
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    extra = {"exactlyOnce": "true", "queryId": f"q-{tag}"} if exactly_once else {}
    values = [f"{tag}-{i}" for i in range(40)]
    write_input(source, "a", values[:15])
    write_input(source, "b", values[15:25])
    query = sink_query(spark, waltz_cluster, source, checkpoint, **extra)
    assert query.awaitTermination(120)
    assert query.exception() is None
    assert len(query.recentProgress) == 2  # one micro-batch per file
    # Stopped; more input; restarted on the same checkpoint: it resumes after the batches it committed.
    write_input(source, "c", values[25:40])
    query = sink_query(spark, waltz_cluster, source, checkpoint, **extra)
    assert query.awaitTermination(120)
    assert query.exception() is None
    got = appended(waltz_cluster, tag)
    assert set(got) == set(values)  # every row at least once
    if exactly_once:
        assert all(n == 1 for n in got.values()), got
    # The run appended only the new file: the checkpoint was resumed, not started again.
    assert sum(p["numInputRows"] for p in query.recentProgress) == 15


def test_exactly_once_query_id_reused_with_a_new_checkpoint_appends_its_rows(
    spark: Any, waltz_cluster: WaltzTestCluster, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    options = {"exactlyOnce": "true", "queryId": f"reused-{tag}"}
    write_input(tmp_path / "in1", "a", [f"{tag}-old-{i}" for i in range(10)])
    first = sink_query(spark, waltz_cluster, tmp_path / "in1", tmp_path / "ck1", **options)
    assert first.awaitTermination(120)
    assert first.exception() is None
    # A new checkpoint starts its batch ids at 0 again: the old query's END(0) must not make it skip them.
    write_input(tmp_path / "in2", "a", [f"{tag}-new-{i}" for i in range(10)])
    second = sink_query(spark, waltz_cluster, tmp_path / "in2", tmp_path / "ck2", **options)
    assert second.awaitTermination(120)
    assert second.exception() is None
    got = appended(waltz_cluster, tag)
    assert sorted(got) == sorted(
        [f"{tag}-old-{i}" for i in range(10)] + [f"{tag}-new-{i}" for i in range(10)]
    )
    assert set(got.values()) == {1}


def test_a_write_to_a_missing_partition_fails_when_planned(
    spark: Any, waltz_cluster: WaltzTestCluster
) -> None:
    # The partition option is checked by the writer Spark asks for when it plans the write (this message
    # exists only there); the old check ran in each task after the client connected, 11.6 s in.
    df = spark.createDataFrame([(b"x",)], "data BINARY")
    with pytest.raises(Exception, match="partition 7 does not exist"):
        df.write.format("waltz").options(**waltz_cluster.options).option("partition", "7").mode(
            "append"
        ).save()
    # A partition column: checked per row against the partition count read when the write was planned,
    # before the task connects to anything.
    rows = spark.createDataFrame([(b"y", 9)], "data BINARY, partition INT")
    with pytest.raises(Exception, match="partition 9, which does not exist"):
        rows.write.format("waltz").options(**waltz_cluster.options).mode("append").save()
