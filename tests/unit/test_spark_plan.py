"""Option parsing, offsets, range planning and admission control of the Spark source (no Spark)."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from waltz.errors import ConfigError
from waltz.spark import plan
from waltz.spark.options import parse_options
from waltz.spark.plan import (
    DataLossError,
    StreamPlanner,
    TxnRange,
    WaltzOffset,
    admit,
    progress_lag,
    resolve_batch_ranges,
    split_ranges,
)
from waltz.spark.source import MemoryLogSource

KEY = MemoryLogSource(1).cluster_key
OTHER_KEY = "11111111-2222-3333-4444-555555555555"

BASE = {"waltz.zookeeper.connectString": "127.0.0.1:2181", "waltz.cluster.root": "/waltz/x"}


def opts(**extra: str) -> dict[str, str]:
    return {**BASE, **extra}


# -- options ------------------------------------------------------------------------------------------------


def test_options_are_case_insensitive_and_typed() -> None:
    o = parse_options(
        {
            "WALTZ.ZOOKEEPER.CONNECTSTRING": "h:1",
            "waltz.cluster.root": "/r",
            "waltz.client.requestTimeout": "1234",
            "PARTITIONS": "2,0,2",
            "startingoffsets": '{"0": 5, "2": -2}',
            "maxRecordsPerPartition": "10",
            "includeData": "FALSE",
            "FetchDepth": "7",
        }
    )
    assert o.client_config.zookeeper_connect_string == "h:1"
    assert o.client_config.request_timeout_ms == 1234
    assert o.partitions == (0, 2)
    assert o.starting_offsets == {0: 5, 2: -2}
    assert o.max_records_per_partition == 10
    assert o.include_data is False
    assert (o.fetch_depth, parse_options(opts()).fetch_depth) == (7, 3)
    assert o.starting(streaming=True) == {0: 5, 2: -2}
    assert parse_options(opts()).starting(streaming=True) == "latest"
    assert parse_options(opts()).starting(streaming=False) == "earliest"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"startingOffset": "earliest"}, "did you mean startingOffsets"),
        ({"waltz.cluster.rooot": "/x"}, "unknown client option"),
        ({"minPartitions": "0"}, "minPartitions: must be at least 1"),
        ({"includeData": "yes please"}, "includeData: expected true or false"),
        ({"startingOffsets": '{"a": 1}'}, "not a partition id"),
        ({"startingOffsets": '{"0": -3}'}, "expected a transaction id"),
        ({"endingOffsets": "tomorrow"}, "expected earliest, latest or JSON"),
        ({"partitions": "0", "startingOffsets": '{"1": 4}'}, "excludes"),
        ({"maxOffsetsPerTrigger": "5", "maxTransactionsPerTrigger": "5"}, "not both"),
        ({"fetchSize": "20000"}, "between 1 and 10000"),
        ({"fetchDepth": "0"}, "fetchDepth: .*between 1 and 16"),
        ({"waltz.client.requestTimeout": "-1"}, "client.requestTimeout"),
    ],
)
def test_bad_options_are_rejected_with_a_clear_message(extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_options(opts(**extra))


def test_cluster_address_is_required() -> None:
    with pytest.raises(ConfigError, match=r"waltz.zookeeper.connectString is required"):
        parse_options({"waltz.cluster.root": "/x"})


def test_options_that_do_not_apply_are_rejected_per_use() -> None:
    with pytest.raises(ConfigError, match=r"maxOffsetsPerTrigger \(stream only\)"):
        parse_options(opts(maxOffsetsPerTrigger="5")).for_batch_read()
    with pytest.raises(ConfigError, match=r"endingOffsets \(batch only\)"):
        parse_options(opts(endingOffsets="latest")).for_stream_read()
    with pytest.raises(ConfigError, match="startingOffsets=latest is not valid for a batch"):
        parse_options(opts(startingOffsets="latest")).for_batch_read()
    with pytest.raises(ConfigError, match="is after endingOffsets"):
        parse_options(opts(startingOffsets='{"0": 9}', endingOffsets='{"0": 3}')).for_batch_read()
    with pytest.raises(ConfigError, match="not valid for a batch write"):
        parse_options(opts(startingOffsets="earliest")).for_write(streaming=False)
    with pytest.raises(ConfigError, match="needs queryId"):
        parse_options(opts(exactlyOnce="true")).for_write(streaming=True)
    with pytest.raises(ConfigError, match="needs the writer's checkpointLocation"):
        parse_options(opts(exactlyOnce="true", queryId="q")).for_write(streaming=True)
    parse_options(opts(exactlyOnce="true", queryId="q", checkpointLocation="/ck")).for_write(streaming=True)


def test_sparks_own_writer_options_pass_through() -> None:
    # DataStreamWriter.option("checkpointLocation") and .queryName() reach the data source's options.
    spark_own = {"checkpointlocation": "/ck", "queryname": "q1", "path": "/p"}
    parsed = parse_options(opts(**spark_own))
    assert parsed.checkpoint_location == "/ck"
    parsed.for_write(streaming=True)
    parsed.for_write(streaming=False)
    parsed.for_stream_read()


def test_kafka_parity_options() -> None:
    parsed = parse_options(opts(minOffsetsPerTrigger="100", maxTriggerDelay="30s"))
    assert (parsed.min_offsets_per_trigger, parsed.max_trigger_delay_ms) == (100, 30_000)
    assert parse_options(opts()).max_trigger_delay_ms == 15 * 60_000
    assert parse_options(opts()).fetch_retry_interval_ms == 10  # Kafka's fetchOffset.retryIntervalMs
    with pytest.raises(ConfigError, match="maxTriggerDelay: expected a duration"):
        parse_options(opts(maxTriggerDelay="soon"))
    with pytest.raises(ConfigError, match="is above maxOffsetsPerTrigger"):
        parse_options(opts(minOffsetsPerTrigger="10", maxOffsetsPerTrigger="5"))
    with pytest.raises(ConfigError, match=r"minOffsetsPerTrigger \(stream only\)"):
        parse_options(opts(minOffsetsPerTrigger="10")).for_batch_read()


# -- offsets ------------------------------------------------------------------------------------------------


def test_offset_json_is_versioned_sorted_and_checked() -> None:
    off = WaltzOffset("c1", {10: 3, 2: 7, 0: 1}, KEY)
    text = json.dumps(off.to_json())
    assert text == (
        f'{{"v": 2, "cluster": "c1", "clusterKey": "{KEY}", "partitions": {{"0": 1, "2": 7, "10": 3}}}}'
    )
    back = WaltzOffset.from_json(json.loads(text), expected_cluster="c1", expected_key=KEY)
    assert dict(back.partitions) == {0: 1, 2: 7, 10: 3}
    with pytest.raises(ConfigError, match="belongs to cluster 'c1'"):
        WaltzOffset.from_json(json.loads(text), expected_cluster="other")
    # Same name, another log: refused by the cluster key.
    with pytest.raises(ConfigError, match=r"belongs to another log .* cluster key"):
        WaltzOffset.from_json(json.loads(text), expected_cluster="c1", expected_key=OTHER_KEY)
    with pytest.raises(ConfigError, match="version 3 is not supported"):
        WaltzOffset.from_json({"v": 3, "cluster": "c1", "partitions": {}})
    with pytest.raises(ConfigError, match="malformed"):
        WaltzOffset.from_json({"v": 2, "cluster": "c1", "partitions": {}})  # v2 without its key
    with pytest.raises(ConfigError, match="bad position"):
        WaltzOffset.from_json({"v": 1, "cluster": "c1", "partitions": {"0": -1}})


def test_old_offsets_are_read_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    plan._warned_v1.clear()
    old = {"v": 1, "cluster": "c1", "partitions": {"0": 4}}
    with caplog.at_level(logging.WARNING, logger="waltz.spark.plan"):
        back = WaltzOffset.from_json(old, expected_cluster="c1", expected_key=KEY)
    assert dict(back.partitions) == {0: 4}
    assert "v1 offsets" in caplog.text
    with pytest.raises(ConfigError, match="belongs to cluster 'c1'"):
        WaltzOffset.from_json(old, expected_cluster="c2", expected_key=KEY)


# -- range planning -----------------------------------------------------------------------------------------


def test_batch_ranges_stop_at_the_committed_high_water_mark() -> None:
    hwms = {0: 9, 1: -1, 2: 4}
    ranges = resolve_batch_ranges("earliest", "latest", [0, 1, 2], hwms, True)
    assert ranges == [TxnRange(0, 0, 10), TxnRange(2, 0, 5)]
    ranges = resolve_batch_ranges({0: 3, 2: -2}, {0: 8}, [0, 1, 2], hwms, True)
    assert ranges == [TxnRange(0, 3, 8), TxnRange(2, 0, 5)]
    with pytest.raises(DataLossError, match="endingOffsets 11 is past the committed log"):
        resolve_batch_ranges("earliest", {0: 11}, [0], hwms, True)
    assert resolve_batch_ranges("earliest", {0: 11}, [0], hwms, False) == [TxnRange(0, 0, 10)]
    with pytest.raises(DataLossError, match="startingOffsets 20"):
        resolve_batch_ranges({0: 20}, "latest", [0], hwms, True)


def test_split_ranges_follows_min_partitions_and_max_records() -> None:
    ranges = [TxnRange(0, 0, 100), TxnRange(1, 50, 60)]
    assert split_ranges(ranges, None, None) == ranges
    pieces = split_ranges(ranges, 11, None)
    assert [p for p in pieces if p.partition == 0] == [TxnRange(0, i * 10, i * 10 + 10) for i in range(10)]
    assert [p for p in pieces if p.partition == 1] == [TxnRange(1, 50, 60)]
    capped = split_ranges(ranges, None, 30)
    assert [(p.partition, p.size) for p in capped] == [(0, 25), (0, 25), (0, 25), (0, 25), (1, 10)]
    for r in ranges:  # pieces cover each range exactly, contiguously
        mine = [p for p in split_ranges(ranges, 7, 13) if p.partition == r.partition]
        assert mine[0].start == r.start
        assert mine[-1].end == r.end
        assert all(a.end == b.start for a, b in itertools.pairwise(mine))
        assert all(p.size <= 13 for p in mine)


def test_admission_shares_the_limit_by_backlog() -> None:
    start = {0: 0, 1: 10, 2: 5}
    available = {0: 100, 1: 10, 2: 55}  # backlogs 100, 0, 50
    assert admit(start, available, None) == available
    end = admit(start, available, 30)
    assert end == {0: 20, 1: 10, 2: 15}
    end = admit(start, available, 1)
    assert sum(end[p] - start[p] for p in start) == 1
    assert admit(start, available, 1000) == available


# -- the streaming planner on an in-memory log --------------------------------------------------------------


def grow(log: MemoryLogSource, counts: dict[int, int]) -> None:
    for p, n in counts.items():
        for _ in range(n):
            log.append(p, f"p{p}".encode())


def test_stream_offsets_never_move_back_or_past_the_committed_log() -> None:
    log = MemoryLogSource(3, cluster_name="mem")
    grow(log, {0: 5, 1: 2})
    planner = StreamPlanner(log, partitions=None, starting="earliest", fail_on_data_loss=True)
    start = planner.initial_offset()
    assert start == {"v": 2, "cluster": "mem", "clusterKey": KEY, "partitions": {"0": 0, "1": 0, "2": 0}}
    end = planner.latest_offset(start, max_rows=4)
    assert sum(end["partitions"].values()) == 4
    assert all(end["partitions"][k] <= v for k, v in {"0": 5, "1": 2, "2": 0}.items())
    ranges = planner.plan(start, end)
    assert all(r.size > 0 for r in ranges)
    assert planner.plan(end, end) == []
    end2 = planner.latest_offset(end, max_rows=None)
    assert end2["partitions"] == {"0": 5, "1": 2, "2": 0}
    assert planner.latest_offset(end2, None) == end2  # nothing new: no movement
    # A checkpoint past the log (restored storage): fail, or hold the position without failOnDataLoss.
    ahead = {"v": 2, "cluster": "mem", "clusterKey": KEY, "partitions": {"0": 50, "1": 2, "2": 0}}
    with pytest.raises(DataLossError, match="only 5 committed"):
        planner.latest_offset(ahead, None)
    lenient = StreamPlanner(log, partitions=None, starting="earliest", fail_on_data_loss=False)
    assert lenient.latest_offset(ahead, None)["partitions"]["0"] == 50
    with pytest.raises(ConfigError, match="moves backwards"):
        planner.plan(end2, start)


def test_available_now_pins_the_target() -> None:
    log = MemoryLogSource(1)
    grow(log, {0: 10})
    planner = StreamPlanner(log, partitions=[0], starting="latest", fail_on_data_loss=True)
    start = planner.initial_offset()
    assert start["partitions"] == {"0": 10}
    grow(log, {0: 5})
    planner.prepare_available_now()
    grow(log, {0: 5})  # arrives after the AvailableNow run started: not part of it
    end = planner.latest_offset(start, max_rows=None)
    assert end["partitions"] == {"0": 15}
    assert planner.latest_reported() == {
        "v": 2,
        "cluster": "memory",
        "clusterKey": KEY,
        "partitions": {"0": 15},
        "lag": {"0": 0},
        "lagTotal": 0,
    }


def test_available_now_fails_on_a_checkpoint_past_the_log() -> None:
    log = MemoryLogSource(2)
    grow(log, {0: 3, 1: 3})
    past = {"v": 2, "cluster": "memory", "clusterKey": KEY, "partitions": {"0": 40, "1": 3}}
    planner = StreamPlanner(log, partitions=None, starting="earliest", fail_on_data_loss=True)
    planner.prepare_available_now()
    with pytest.raises(DataLossError, match="checkpoint is at transaction 40"):
        planner.latest_offset(past, max_rows=None)
    lenient = StreamPlanner(log, partitions=None, starting="earliest", fail_on_data_loss=False)
    lenient.prepare_available_now()
    assert lenient.latest_offset(past, max_rows=None)["partitions"] == {"0": 40, "1": 3}


def test_lag_is_reported_per_partition_and_in_total() -> None:
    log = MemoryLogSource(2)
    grow(log, {0: 30, 1: 10})
    planner = StreamPlanner(log, partitions=None, starting="earliest", fail_on_data_loss=True)
    assert planner.latest_reported() is None
    start = planner.initial_offset()
    planner.latest_offset(start, max_rows=8)  # 6 of partition 0, 2 of partition 1
    report = planner.latest_reported()
    assert report is not None
    assert report["lag"] == {"0": 24, "1": 8}
    assert report["lagTotal"] == 32
    progress = {"sources": [{"description": "x", "latestOffset": json.dumps(report)}]}
    assert progress_lag(progress) == {"total": 32, "partitions": {0: 24, 1: 8}}
    assert progress_lag(None) is None


def test_min_offsets_per_trigger_waits_up_to_max_trigger_delay() -> None:
    log = MemoryLogSource(1)
    now = [0.0]
    planner = StreamPlanner(
        log,
        partitions=None,
        starting="earliest",
        fail_on_data_loss=True,
        min_offsets_per_trigger=10,
        max_trigger_delay_ms=5000,
        clock=lambda: now[0],
    )
    start = planner.initial_offset()
    grow(log, {0: 4})
    now[0] = 1.0
    assert planner.latest_offset(start, None) == start  # 4 < 10 and only 1 s waited: no batch
    grow(log, {0: 6})
    end = planner.latest_offset(start, None)
    assert end["partitions"] == {"0": 10}  # 10 pending: a batch
    grow(log, {0: 3})
    now[0] = 3.0
    assert planner.latest_offset(end, None) == end
    now[0] = 6.5  # maxTriggerDelay since the last batch (at 1 s) has passed: 3 go anyway
    assert planner.latest_offset(end, None)["partitions"] == {"0": 13}


def test_memory_source_reads_consecutive_verified_batches() -> None:
    log = MemoryLogSource(1, fetch_size=4)
    grow(log, {0: 10})
    batches = list(log.read(0, 3, 10))
    assert [(b.first, b.count) for b in batches] == [(3, 4), (7, 3)]
    assert [r.transaction_id for b in batches for r in b.records()] == list(range(3, 10))
