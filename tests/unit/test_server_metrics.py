"""The server's commit metrics, counted in plain Python and exported when scraped: what the prometheus
Counters and Histogram they replaced exported (same names, labels, buckets, values), and counts that outlive
a partition's Partition object; the live per-partition gauges."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from waltz.server.metrics import CommitMetrics, PartitionGauges, ServerMetrics

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0)


def _lines(registry: CollectorRegistry) -> list[str]:
    return sorted(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)


def test_commit_metrics_export_what_prometheus_counters_and_a_histogram_would() -> None:
    reference, ours = CollectorRegistry(), CollectorRegistry()
    appends = Counter("waltz_server_appends", "Committed appends", ["partition"], registry=reference)
    data = Counter(
        "waltz_server_appended_bytes", "Data bytes of committed appends", ["partition"], registry=reference
    )
    latency = Histogram(
        "waltz_server_append_seconds",
        "Time from an append's arrival to its commit",
        ["partition"],
        buckets=BUCKETS,
        registry=reference,
    )
    commits = CommitMetrics()
    ours.register(commits)
    seconds = (0.0001, 0.0005, 0.0007, 0.001, 0.3, 0.5, 2.0, 1.0, 0.02, 0.0, 5.0, 7.5)
    for i, s in enumerate(seconds):
        label = str(i % 3)
        appends.labels(label).inc(30 + i)
        data.labels(label).inc(512 * (30 + i))
        latency.labels(label).observe(s)
        partition = commits.for_partition(label)
        partition.appended(30 + i, 512 * (30 + i))
        partition.latency(s)
    assert _lines(ours) == _lines(reference)


def test_a_partition_reopened_here_keeps_counting_from_where_it_was() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    first = metrics.for_partition(4)
    first.appended(10, 5120)
    first.latency(0.003)
    again = metrics.for_partition(4)  # a new Partition object for partition 4 (a generation change)
    again.appended(2, 1024)
    again.latency(0.03)
    exported = generate_latest(registry).decode().splitlines()
    assert 'waltz_server_appends_total{partition="4"} 12.0' in exported
    assert 'waltz_server_appended_bytes_total{partition="4"} 6144.0' in exported
    assert 'waltz_server_append_seconds_count{partition="4"} 2.0' in exported
    assert 'waltz_server_append_seconds_bucket{le="0.005",partition="4"} 1.0' in exported


def test_partition_gauges_show_exactly_the_owned_partitions_with_their_live_values() -> None:
    def part(hwm: int, generation: int, healthy: bool) -> Any:
        store = SimpleNamespace(damaged_replicas={"s1": 2, "s2": 1})
        return SimpleNamespace(
            high_water_mark=hwm,
            pending_appends=3,
            feed_context_count=4,
            generation=generation,
            is_healthy=healthy,
            store=store,
        )

    owned: dict[int, Any] = {0: part(41, 7, True), 5: part(-1, 2, False)}
    registry = CollectorRegistry()
    registry.register(PartitionGauges(lambda: owned))
    lines = _lines(registry)
    assert 'waltz_server_high_water_mark{partition="0"} 41.0' in lines
    assert 'waltz_server_generation{partition="5"} 2.0' in lines
    assert 'waltz_server_partition_healthy{partition="5"} 0.0' in lines
    assert 'waltz_server_damaged_replica_reads{partition="0"} 3.0' in lines
    owned[0].high_water_mark = 42  # read when scraped, not copied when the partition opened
    del owned[5]  # moved away: its series go with it
    lines = _lines(registry)
    assert 'waltz_server_high_water_mark{partition="0"} 42.0' in lines
    assert not [line for line in lines if 'partition="5"' in line]
