"""The ``waltz`` source over a trimmed partition (issue 26): ``failOnDataLoss`` (the default) fails a read
that starts below the trim point with the TrimmedError's message; ``false`` starts at the trim point with a
WARNING, as Kafka's source does. Its own cluster: a trim is for good, and the other Spark tests read
from 0."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.client_cluster import CounterApp
from tests.spark.conftest import WaltzTestCluster
from waltz import WaltzClient
from waltz.cluster import zk
from waltz.cluster.retention import update_retention
from waltz.errors import TrimmedError
from waltz.local import UpOptions, configs, down, up
from waltz.spark.cluster import close_all
from waltz.spark.datasource import _past_trim_point
from waltz.spark.options import parse_options
from waltz.spark.writer import close_idle_sessions

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.timeout(300)]

RECORDS = 50
TRIM_POINT = 30


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WaltzTestCluster]:
    directory = tmp_path_factory.mktemp("waltz-trimmed")
    cluster = up(UpOptions(directory=directory, storages=1, servers=1, partitions=1))
    try:
        log = WaltzTestCluster(
            directory,
            {
                "waltz.zookeeper.connectString": cluster.zk_connect,
                "waltz.cluster.root": cluster.cluster_root,
                "waltz.zookeeper.sessionTimeout": "10000",
            },
        )
        log.append([{"partition": 0, "data": b"r%d" % i} for i in range(RECORDS)])
        zk_client = configs.zk_connect(cluster, 10_000)
        try:  # No grace: the trim is in force at once (see test_retention for the grace).
            update_retention(zk_client, cluster.cluster_root, grace_ms=0)
        finally:
            zk.close(zk_client)
        with WaltzClient(CounterApp(1), log.client_config) as client:
            outcome = client.trim(0, TRIM_POINT, min_kept_transactions=10)
        assert outcome.after == TRIM_POINT
        yield log
    finally:
        close_all()
        close_idle_sessions()
        down(directory)


def test_a_read_below_the_trim_point_fails_by_default(spark: Any, trimmed: WaltzTestCluster) -> None:
    df = spark.read.format("waltz").options(**trimmed.options).load()
    with pytest.raises(Exception, match="transaction 0 is below the trim point 30") as caught:
        df.collect()
    assert "set failOnDataLoss=false to start at the trim point" in str(caught.value)


def test_without_fail_on_data_loss_a_read_starts_at_the_trim_point(
    spark: Any, trimmed: WaltzTestCluster, caplog: pytest.LogCaptureFixture
) -> None:
    df = spark.read.format("waltz").options(**trimmed.options).option("failOnDataLoss", "false").load()
    rows = sorted((r.transactionId, bytes(r.data)) for r in df.collect())
    assert rows == [(i, b"r%d" % i) for i in range(TRIM_POINT, RECORDS)]
    # Split into several tasks, one of them wholly below the trim point: still each row once.
    split = (
        spark.read.format("waltz")
        .options(**trimmed.options)
        .option("failOnDataLoss", "false")
        .option("maxRecordsPerPartition", "20")
        .load()
    )
    assert sorted(r.transactionId for r in split.collect()) == list(range(TRIM_POINT, RECORDS))
    # The warning is said by the task, in a Spark worker process: checked on the function directly.
    options = parse_options({**trimmed.options, "failOnDataLoss": "false"})
    with caplog.at_level(logging.WARNING, logger="waltz.spark.datasource"):
        assert _past_trim_point(options, TrimmedError.below(0, 3, TRIM_POINT), 3) == TRIM_POINT
    assert "transaction 3 is below the trim point 30" in caplog.text
    assert "starting at the trim point (failOnDataLoss=false)" in caplog.text
