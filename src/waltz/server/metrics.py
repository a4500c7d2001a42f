"""The server's Prometheus metrics: per-partition commits and latency, caches, and the store's statistics.

Counted on the hot path as plain numbers (:class:`PartitionCommits`) and turned into metric families only when
scraped (:class:`CommitMetrics`, :class:`StoreCollector`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from waltz.server.feed_cache import FeedCache
from waltz.server.partition import Partition, PartitionMetrics
from waltz.server.store.store_partition import BATCH_APPENDS_BOUNDS, StorePartition
from waltz.server.store.store_session import EndReason
from waltz.server.transaction_cache import TransactionCache

__all__ = ["CommitMetrics", "PartitionCommits", "ServerMetrics", "StoreCollector"]


class PartitionCommits:
    """One partition's committed appends, data bytes and commit latencies, counted in plain Python (the
    partition reports them once per loop iteration) and exported by :class:`CommitMetrics` when scraped."""

    __slots__ = ("appends", "bounds", "data_bytes", "latency_counts", "latency_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.appends = 0
        self.data_bytes = 0
        self.latency_counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.latency_sum = 0.0

    def appended(self, count: int, data_bytes: int) -> None:
        self.appends += count
        self.data_bytes += data_bytes

    def latency(self, seconds: float) -> None:
        # bisect_left: a value equal to a bound counts in that bound's bucket (le), as a Histogram's does.
        self.latency_counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.latency_sum += seconds


class CommitMetrics(Collector):
    """``waltz_server_appends_total``, ``waltz_server_appended_bytes_total`` and the
    ``waltz_server_append_seconds`` histogram, per partition, read from plain counts when scraped. Prometheus
    Counters and a Histogram cost a lock and several Python calls per update (two counters and a bucket loop
    per batch: a few tenths of a µs per append). The same names, labels and buckets as those were; a
    partition's counts outlive its Partition object (a generation change), so they only grow."""

    _BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0)

    def __init__(self) -> None:
        self._partitions: dict[str, PartitionCommits] = {}

    def for_partition(self, label: str) -> PartitionCommits:
        commits = self._partitions.get(label)
        if commits is None:
            commits = self._partitions[label] = PartitionCommits(self._BUCKETS)
        return commits

    def collect(self) -> Iterator[Metric]:
        appends = CounterMetricFamily("waltz_server_appends", "Committed appends", labels=["partition"])
        data = CounterMetricFamily(
            "waltz_server_appended_bytes", "Data bytes of committed appends", labels=["partition"]
        )
        latency = HistogramMetricFamily(
            "waltz_server_append_seconds", "Time from an append's arrival to its commit", labels=["partition"]
        )
        for label, commits in sorted(self._partitions.items()):
            appends.add_metric([label], commits.appends)
            data.add_metric([label], commits.data_bytes)
            latency.add_metric(
                [label], _histogram_buckets(commits.bounds, commits.latency_counts), commits.latency_sum
            )
        yield appends
        yield data
        yield latency


@functools.cache
def _le_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The "le" labels of ``bounds``, made once: a scrape writes them for every partition."""
    return tuple(floatToGoString(b) for b in bounds)  # type: ignore[no-untyped-call]


def _histogram_buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """A histogram's ``(le, cumulative count)`` buckets from per-bucket ``counts`` (one per bound, then one
    above every bound), the "le" labels as prometheus_client's own Histogram writes them (its helper is
    untyped)."""
    cumulative = list(itertools.accumulate(counts))
    buckets: list[tuple[str, float]] = list(zip(_le_labels(tuple(bounds)), cumulative, strict=False))
    buckets.append(("+Inf", cumulative[-1]))
    return buckets


class ServerMetrics:
    """The server's registered families. Every labelled counter has a series for each of the cluster's
    partitions from the start, at 0, owned or not: a series born at 1 shows no ``increase()`` for the event
    that made it (a partition's first generation change on a restarted server, say)."""

    def __init__(self, registry: CollectorRegistry, num_partitions: int = 0) -> None:
        self.commits = CommitMetrics()
        registry.register(self.commits)
        self.lock_failures = Counter(
            "waltz_server_lock_failures",
            "Appends rejected by a lock conflict",
            ["partition"],
            registry=registry,
        )
        self.failed = Counter(
            "waltz_server_failed_appends", "Appends that failed", ["partition"], registry=registry
        )
        self.cache_hit_rate = Gauge(
            "waltz_server_cache_hit_ratio", "Cache hits / lookups", ["cache"], registry=registry
        )
        self.partitions = Gauge("waltz_server_partitions", "Partitions owned", registry=registry)
        self.read_bytes = Counter(
            "waltz_server_read_bytes",
            "Data bytes sent to clients by transaction data and range reads",
            ["partition"],
            registry=registry,
        )
        self.generation_changes = Counter(
            "waltz_server_generation_changes",
            "Generations this server took a partition at (opened, or raised while owned)",
            ["partition"],
            registry=registry,
        )
        for pid in range(num_partitions):
            p = str(pid)
            self.commits.for_partition(p)
            for counter in (self.lock_failures, self.failed, self.read_bytes, self.generation_changes):
                counter.labels(p)

    def export_caches(self, feed: FeedCache, transactions: TransactionCache) -> None:
        for name, cache in (("feed", feed), ("transaction", transactions)):
            self.cache_hit_rate.labels(name).set_function(_hit_ratio(cache))

    def for_partition(self, pid: int) -> PartitionMetrics:
        p = str(pid)
        commits = self.commits.for_partition(p)
        return PartitionMetrics(
            appended=commits.appended,
            lock_failed=self.lock_failures.labels(p).inc,
            failed=self.failed.labels(p).inc,
            latency=commits.latency,
        )


_PARTITION_GAUGES: tuple[tuple[str, str, Callable[[Partition], float]], ...] = (
    ("waltz_server_high_water_mark", "Committed high-water mark", lambda p: p.high_water_mark),
    ("waltz_server_pending_appends", "Appends in flight", lambda p: p.pending_appends),
    ("waltz_server_feed_contexts", "Mounted clients", lambda p: p.feed_context_count),
    ("waltz_server_generation", "Partition generation", lambda p: p.generation),
    ("waltz_server_partition_healthy", "1 if a store session is open", lambda p: 1 if p.is_healthy else 0),
    (
        "waltz_server_damaged_replica_reads",
        "Reads that found a replica's stored copy damaged and went to another replica",
        lambda p: sum(p.store.damaged_replicas.values()),
    ),
)


class PartitionGauges(Collector):
    """The live state of each partition this server owns, read when scraped (a scrape of /metrics alone sees
    the current high-water mark). A collector over the owned partitions rather than labelled gauges set as a
    partition opens and removed as it closes: the scrape runs on a thread (see :mod:`waltz.http`) and must
    never see a partition's series just created at 0, nor one left behind after it moved away."""

    def __init__(self, partitions: Callable[[], dict[int, Partition]]) -> None:
        self._partitions = partitions

    def describe(self) -> list[Any]:
        return []  # no eager collection at registration: the server has no partitions yet

    def collect(self) -> Iterator[Metric]:
        owned = sorted(dict(self._partitions()).items())  # one C-level copy: the loop may change it meanwhile
        for name, documentation, value in _PARTITION_GAUGES:
            family = GaugeMetricFamily(name, documentation, labels=["partition"])
            for pid, part in owned:
                family.add_metric([str(pid)], value(part))
            yield family


class _StoreTotals:
    """One partition's store counts summed over the incarnations this server had of it (each a
    :class:`StorePartition` with counts of its own), so the exported counters only grow."""

    def __init__(self) -> None:
        self.opened = 0
        self.ended = dict.fromkeys((r.value for r in EndReason), 0)
        self.recovery_seconds = 0.0
        self.batch_counts = [0] * (len(BATCH_APPENDS_BOUNDS) + 1)
        self.batch_appends = 0
        self.repairs = dict.fromkeys(_REPAIR_OUTCOMES, 0)
        self.repaired_records = 0

    def add(self, store: StorePartition) -> None:
        stats = store.stats
        self.opened += stats.sessions_opened
        for reason, count in list(stats.sessions_ended.items()):  # scraped on a thread: copy, then iterate
            self.ended[reason] = self.ended.get(reason, 0) + count
        self.recovery_seconds += stats.recovery_seconds_sum
        batch_counts = stats.batch_appends_counts
        self.batch_counts = [a + b for a, b in zip(self.batch_counts, batch_counts, strict=True)]
        self.batch_appends += stats.batch_appends_sum
        counts = store.repairs
        self.repairs["started"] += counts.started
        self.repairs["finished"] += counts.finished
        self.repairs["failed"] += counts.failed
        self.repaired_records += counts.records

    def plus(self, store: StorePartition | None) -> _StoreTotals:
        total = _StoreTotals()
        total.opened = self.opened
        total.ended = dict(self.ended)
        total.recovery_seconds = self.recovery_seconds
        total.batch_counts = list(self.batch_counts)
        total.batch_appends = self.batch_appends
        total.repairs = dict(self.repairs)
        total.repaired_records = self.repaired_records
        if store is not None:
            total.add(store)
        return total


_REPAIR_OUTCOMES = {
    "started": "started",
    "finished": "every reported record rewritten from a good copy",
    "failed": "ended early (tried again later)",
}


class StoreCollector:
    """Store state read when scraped: replica lag and role per replica, store sessions, recovery time.

    A collector rather than labelled gauges: the replica set of a partition changes with every session, and
    the numbers live in the store already (:meth:`StorePartition.replica_positions`, ``stats``). The counters
    are per partition of the cluster (``num_partitions``), at 0 from the start, and summed over every
    incarnation of the partition on this server: a store that closed (its partition moved away, or came back
    at a new generation) is added to the partition's retired totals at the next scrape."""

    def __init__(self, partitions: Callable[[], dict[int, Partition]], num_partitions: int = 0) -> None:
        self._partitions = partitions
        self._num_partitions = num_partitions
        self._seen: dict[int, StorePartition] = {}
        self._retired: dict[int, _StoreTotals] = {}

    def describe(self) -> list[Any]:
        return []  # no eager collection at registration: the server has no partitions yet

    def totals(self, owned: dict[int, Partition]) -> dict[int, _StoreTotals]:
        """Every known partition's counts now (owned, owned before, or in the cluster)."""
        stores = {pid: part.store for pid, part in owned.items()}
        for pid, store in list(self._seen.items()):
            if stores.get(pid) is not store:
                self._retired.setdefault(pid, _StoreTotals()).add(store)
                del self._seen[pid]
        self._seen.update(stores)
        pids = set(range(self._num_partitions)) | set(self._retired) | set(stores)
        empty = _StoreTotals()
        return {pid: self._retired.get(pid, empty).plus(stores.get(pid)) for pid in sorted(pids)}

    def collect(self) -> Iterator[Any]:
        lag = GaugeMetricFamily(
            "waltz_server_replica_lag",
            "Committed transactions a replica of the open store session does not hold yet",
            labels=["partition", "replica"],
        )
        state = GaugeMetricFamily(
            "waltz_server_replica_participant",
            "1 if the replica takes part in the open store session's writes, 0 if it is recovering or out",
            labels=["partition", "replica", "role"],
        )
        owned = dict(self._partitions())  # one C-level copy: this runs on the scrape thread (see waltz.http)
        for pid, part in sorted(owned.items()):
            store = part.store
            hwm = store.high_water_mark
            for replica, (role, max_id) in sorted(store.replica_positions().items()):
                lag.add_metric([str(pid), replica], max(0, hwm - max_id))
                state.add_metric([str(pid), replica, role], 1 if role == "participant" else 0)
        yield lag
        yield state
        yield from self._counters(self.totals(owned))

    def _counters(self, totals: dict[int, _StoreTotals]) -> Iterator[Metric]:
        opened = CounterMetricFamily(
            "waltz_server_store_sessions_opened", "Store sessions opened", labels=["partition"]
        )
        ended = CounterMetricFamily(
            "waltz_server_store_sessions_ended",
            "Store sessions ended, by reason",
            labels=["partition", "reason"],
        )
        recovery = SummaryMetricFamily(
            "waltz_server_recovery_seconds",
            "Time from a store session's start to its opening (replica recovery and the vote)",
            labels=["partition"],
        )
        repairs = {
            outcome: CounterMetricFamily(
                f"waltz_server_scrub_repairs_{outcome}",
                f"Repairs of records a storage node's scrub reported damaged: {what}",
                labels=["partition"],
            )
            for outcome, what in _REPAIR_OUTCOMES.items()
        }
        batches = HistogramMetricFamily(
            "waltz_server_store_batch_appends",
            "Appends per committed batch (each batch is one write request and one fsync on every replica)",
            labels=["partition"],
        )
        repaired = CounterMetricFamily(
            "waltz_server_scrub_repaired_records",
            "Records rewritten on a replica from a good copy after its scrub reported them damaged",
            labels=["partition"],
        )
        for pid, total in totals.items():
            p = str(pid)
            opened.add_metric([p], total.opened)
            for reason, count in sorted(total.ended.items()):
                ended.add_metric([p, reason], count)
            recovery.add_metric([p], total.opened, total.recovery_seconds)
            batches.add_metric(
                [p], _histogram_buckets(BATCH_APPENDS_BOUNDS, total.batch_counts), total.batch_appends
            )
            for outcome, family in repairs.items():
                family.add_metric([p], total.repairs[outcome])
            repaired.add_metric([p], total.repaired_records)
        yield from (opened, ended, recovery, batches, *repairs.values(), repaired)


def _hit_ratio(cache: FeedCache | TransactionCache) -> Callable[[], float]:
    def ratio() -> float:
        stats = cache.statistics()
        lookups = stats.hits + stats.misses
        return stats.hits / lookups if lookups else 0.0

    return ratio
