"""A stream never skips or loses data silently: data loss under AvailableNow, a checkpoint of another log, a
partition that is not served (issue 12, items 2, 3 and 5)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.spark.conftest import NUM_PARTITIONS, WaltzTestCluster
from waltz.client.reader import LogReader
from waltz.errors import ClientTimeoutError, PartitionNotReadyError
from waltz.local import UpOptions, down, kill, start, up
from waltz.spark.cluster import close_all
from waltz.spark.writer import close_idle_sessions

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def second_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WaltzTestCluster]:
    """Another ``waltz local`` cluster: also named ``local``, with its own cluster key."""
    directory = tmp_path_factory.mktemp("waltz-second")
    cluster = up(UpOptions(directory=directory, storages=1, servers=1, partitions=NUM_PARTITIONS))
    try:
        yield WaltzTestCluster(
            directory,
            {
                "waltz.zookeeper.connectString": cluster.zk_connect,
                "waltz.cluster.root": cluster.cluster_root,
                "waltz.zookeeper.sessionTimeout": "10000",
                # Unserved partitions are retried within this; keep the failing reads short.
                "waltz.client.requestTimeout": "1500",
            },
        )
    finally:
        close_all()
        close_idle_sessions()
        down(directory)


def run_available_now(spark: Any, options: dict[str, str], checkpoint: Path, **extra: str) -> Any:
    """One ``Trigger.AvailableNow`` run of the waltz source into a noop sink; returns the ended query."""
    query = (
        spark.readStream.format("waltz")
        .options(**options)
        .options(**extra)
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(120)
    except Exception:  # a failed query: the callers look at query.exception()
        assert query.exception() is not None
    return query


def rewrite_last_offset(checkpoint: Path, edit: Any) -> None:
    """Edit the source offset of the checkpoint's last micro-batch (the start of the next run)."""
    last = max((checkpoint / "offsets").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    lines = last.read_text().splitlines()
    lines[-1] = json.dumps(edit(json.loads(lines[-1])))
    last.write_text("\n".join(lines))


def test_available_now_fails_on_a_checkpoint_past_the_log(
    spark: Any, waltz_cluster: WaltzTestCluster, tmp_path: Path
) -> None:
    waltz_cluster.append([{"partition": p, "data": b"x"} for p in range(NUM_PARTITIONS)])
    checkpoint = tmp_path / "checkpoint"
    first = run_available_now(spark, waltz_cluster.options, checkpoint, startingOffsets="earliest")
    assert first.exception() is None

    def past_the_end(offset: dict[str, Any]) -> dict[str, Any]:
        offset["partitions"]["0"] += 1000  # as after a restored (shorter) log
        return offset

    rewrite_last_offset(checkpoint, past_the_end)
    query = run_available_now(spark, waltz_cluster.options, checkpoint)
    assert query.exception() is not None
    assert "failOnDataLoss" in str(query.exception())
    assert "checkpoint is at transaction" in str(query.exception())
    # failOnDataLoss=false: a warning, the run ends without reading anything it should not.
    lenient = run_available_now(spark, waltz_cluster.options, checkpoint, failOnDataLoss="false")
    assert lenient.exception() is None


def test_a_checkpoint_of_another_log_with_the_same_name_fails(
    spark: Any, waltz_cluster: WaltzTestCluster, second_cluster: WaltzTestCluster, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "checkpoint"
    waltz_cluster.append([{"partition": 0, "data": b"on the first log"}])
    assert run_available_now(spark, waltz_cluster.options, checkpoint).exception() is None
    offset = json.loads((checkpoint / "offsets" / "0").read_text().splitlines()[-1])
    assert offset["cluster"] == "local"
    assert len(offset["clusterKey"]) == 36
    # Both clusters are named "local": only the cluster key tells them apart. Even without failOnDataLoss
    # the other log is refused (it would skip or re-read that log's transactions).
    query = run_available_now(spark, second_cluster.options, checkpoint, failOnDataLoss="false")
    assert query.exception() is not None
    message = str(query.exception())
    assert "belongs to another log" in message
    assert offset["clusterKey"] in message
    # A checkpoint written before offsets carried the key (v1) is still read on its own log.
    rewrite_last_offset(
        checkpoint, lambda o: {"v": 1, "cluster": o["cluster"], "partitions": o["partitions"]}
    )
    tag = uuid.uuid4().hex.encode()
    waltz_cluster.append([{"partition": 1, "data": tag}])
    resumed = run_available_now(spark, waltz_cluster.options, checkpoint)
    assert resumed.exception() is None
    assert sum(p["numInputRows"] for p in resumed.recentProgress) == 1


def wait_unserved(options: dict[str, str], partition: int, timeout_s: float = 60) -> str:
    """Wait until the restarted server owns ``partition`` without serving it; returns the error message."""
    from waltz.spark.options import parse_options

    config = parse_options(options).client_config
    deadline = time.monotonic() + timeout_s
    while True:

        async def attempt() -> str:
            async with LogReader(config) as reader:
                try:
                    hwm = await reader.high_water_mark(partition)
                except ClientTimeoutError as e:
                    return str(e)
                return f"served, high-water mark {hwm}"

        message = asyncio.run(attempt())
        if "is not served" in message or time.monotonic() > deadline:
            return message
        time.sleep(0.5)


def test_an_unserved_partition_fails_every_read_path(
    spark: Any, second_cluster: WaltzTestCluster, tmp_path: Path
) -> None:
    # Committed records on the only replica, then the replica goes and the server restarts: the server owns
    # the partitions but cannot open their store, so it does not know their high-water marks.
    second_cluster.append(
        [{"partition": p, "data": b"committed"} for p in range(NUM_PARTITIONS) for _ in range(5)]
    )
    close_all()  # this process's connections to the server that is about to go
    close_idle_sessions()
    kill(second_cluster.directory, "storage", 0)
    kill(second_cluster.directory, "server", 0)
    start(second_cluster.directory, "server", 0)
    message = wait_unserved(second_cluster.options, 0)
    assert "partition 0 is not served" in message

    config = second_cluster.client_config

    async def reader_paths() -> list[BaseException]:
        errors: list[BaseException] = []
        async with LogReader(config) as reader:
            for call in (reader.high_water_mark(1), reader.read_range(1, 0, 10), reader.read_run(1, 0, 10)):
                try:
                    await call
                except ClientTimeoutError as e:
                    errors.append(e)
            records = reader.read(1, 0, 4)
            try:
                await records.__anext__()
            except ClientTimeoutError as e:
                errors.append(e)
        return errors

    errors = asyncio.run(reader_paths())
    assert len(errors) == 4
    for e in errors:
        assert e.retriable  # the partition may be served again later
        assert isinstance(e.__cause__, PartitionNotReadyError)
        assert "partition 1 is not served" in str(e)

    # The Spark source: planning a batch read fails instead of reporting empty partitions.
    with pytest.raises(Exception, match="is not served"):
        (
            spark.read.format("waltz")
            .options(**second_cluster.options)
            .option("fetchOffset.numRetries", "0")
            .load()
            .collect()
        )
    # The CLI: an error and a non-zero exit status, not "-1".
    client_yaml = second_cluster.directory / "client.yaml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "waltz.cli.main",
            "client",
            "high-water-mark",
            "-c",
            str(client_yaml),
            "-p",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "not served" in result.stderr
    assert "-1" not in result.stdout
