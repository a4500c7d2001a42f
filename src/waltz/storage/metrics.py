"""The storage node's Prometheus metrics: the registered families, and the collectors that read plain counts
when scraped (cheaper than a prometheus Counter or Histogram update on the append path).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from waltz.storage.index_writes import FLUSHED_INDEX_DELAY_S

log = logging.getLogger(__name__)


class PartitionCounters(Protocol):
    """What :class:`AppendCounters` reads of each partition (a ``StoragePartition``)."""

    @property
    def partition_id(self) -> int: ...
    @property
    def appended_records(self) -> int: ...
    @property
    def appended_bytes(self) -> int: ...
    @property
    def extending_writes(self) -> int: ...
    @property
    def fsync_count(self) -> int: ...
    @property
    def threaded_fsync_count(self) -> int: ...
    @property
    def preallocated_bytes(self) -> int: ...
    @property
    def preallocate_failures(self) -> int: ...


FAILURE_NAMES = (
    "CorruptionError",
    "PartitionNotAssignedError",
    "SessionFencedError",
    "StorageError",
    "TransactionOutOfOrderError",
)
"""The errors a storage node answers with, whose ``waltz_storage_failures_total`` series exist from the start
(at 0, so Prometheus sees their first increase); any other error gets its series when it first happens."""


class Metrics:
    """The node's registered families. Every labelled counter has its series for every known label value (the
    node's partitions, :data:`FAILURE_NAMES`, both ports) from the start, at 0: a series born at 1 shows no
    ``increase()`` for that first event."""

    def __init__(self, registry: CollectorRegistry, num_partitions: int = 0) -> None:
        # Appends counted from 0 at start (as the Counter's child made up front was): an idle node's rate is
        # 0 rather than missing, and increase() sees the first appends.
        self.requests = RequestCounts(("AppendRequest", "MultiAppendRequest", "AppendInMultiAppend"))
        registry.register(self.requests)
        self.failures = Counter("waltz_storage_failures", "Failure responses", ["error"], registry=registry)
        self.append_latency = Latency(
            "waltz_storage_append_seconds",
            "Time from an append's arrival to its acknowledgement",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
        )
        registry.register(self.append_latency)
        self.max_txn = Gauge(
            "waltz_storage_max_transaction_id", "Max transaction id", ["partition"], registry=registry
        )
        self.session = Gauge(
            "waltz_storage_session_id", "Fencing session id", ["partition"], registry=registry
        )
        self.queue = Gauge("waltz_storage_queue_size", "Queued requests", ["partition"], registry=registry)
        self.connections = Gauge("waltz_storage_connections", "Open data connections", registry=registry)
        self.corrupt_records = Counter(
            "waltz_storage_corrupt_records",
            "Stored records found damaged (checksum, id or length) by a read",
            ["partition"],
            registry=registry,
        )
        self.repaired_records = Counter(
            "waltz_storage_repaired_records",
            "Damaged records overwritten with a good copy from another replica",
            ["partition"],
            registry=registry,
        )
        self.refused_peers = Counter(
            "waltz_storage_refused_peers",
            "Connections refused because the peer certificate is not in storage.ssl.allowedPeers",
            ["port"],
            registry=registry,
        )
        self.refused_sessions = Counter(
            "waltz_storage_refused_session_ids",
            "Requests refused for a session id the cluster's metadata never handed out",
            ["partition"],
            registry=registry,
        )
        self.read_bytes = Counter(
            "waltz_storage_read_bytes",
            "Data bytes of records read by servers",
            ["partition"],
            registry=registry,
        )
        self.disk_bytes = Gauge(
            "waltz_storage_disk_bytes", "Bytes of the files in the storage directory", registry=registry
        )
        self.disk_free_bytes = Gauge(
            "waltz_storage_disk_free_bytes",
            "Bytes free on the file system of the storage directory",
            registry=registry,
        )
        self.partitions_assigned = Gauge(
            "waltz_storage_partitions_assigned", "Partitions assigned to this node", registry=registry
        )
        self.partitions_available = Gauge(
            "waltz_storage_partitions_available",
            "Assigned partitions that are available (online)",
            registry=registry,
        )
        self._precreate(num_partitions)
        self._health_gauges(registry)

    def _health_gauges(self, registry: CollectorRegistry) -> None:
        """Damage and health, read when scraped (the node sets their functions)."""
        self.damaged_replicas = Gauge(
            "waltz_storage_damaged_replicas",
            "Partitions whose replica on this node is damaged (missing or unreadable files, or a damaged "
            "control-file entry): it does not vote in recovery until repaired",
            registry=registry,
        )
        self.damaged_records = Gauge(
            "waltz_storage_damaged_records",
            "Stored records found damaged and not repaired yet",
            registry=registry,
        )
        self.partitions_unhealthy = Gauge(
            "waltz_storage_partitions_unhealthy",
            "Partitions refusing requests: fail-stopped by a failed write or fsync, failed, or damaged",
            registry=registry,
        )

    def _precreate(self, num_partitions: int) -> None:
        for name in FAILURE_NAMES:
            self.failures.labels(name)
        for port in ("data", "admin"):
            self.refused_peers.labels(port)
        for pid in range(num_partitions):
            for per_partition in (self.corrupt_records, self.repaired_records, self.refused_sessions):
                per_partition.labels(pid)
            self.read_bytes.labels(pid)


class Latency(Collector):
    """A histogram observed once per group commit and exported when scraped, as a prometheus Histogram of the
    same name and buckets would be: a Histogram's ``observe`` (a lock, a Python loop over the buckets, two
    counter updates) was the costliest metric update on the append path; this one is a bisect and two adds.
    Single event loop; no locking."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def collect(self) -> Iterable[Metric]:
        cumulative = list(itertools.accumulate(self._counts))
        buckets = [(repr(b), c) for b, c in zip(self._bounds, cumulative, strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        family = HistogramMetricFamily(self._name, self._documentation)
        family.add_metric([], buckets, self._sum)
        yield family


class RequestCounts(Collector):
    """``waltz_storage_requests_total{type}``: requests processed, counted in a dict and exported when scraped
    (a prometheus Counter's ``inc`` takes a lock and four calls, on the path of every append group)."""

    def __init__(self, kinds: Iterable[str] = ()) -> None:
        self.counts: dict[str, int] = dict.fromkeys(kinds, 0)

    def inc(self, kind: str, n: int = 1) -> None:
        counts = self.counts
        counts[kind] = counts.get(kind, 0) + n

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("waltz_storage_requests", "Requests processed", labels=["type"])
        for kind, n in sorted(self.counts.items()):
            family.add_metric([kind], n)
        yield family


class HandoffCounts(Protocol):
    """What :class:`AppendCounters` reads of the node's group fsyncs (a ``GroupSync``)."""

    @property
    def handoffs(self) -> int: ...

    @property
    def syncfs_calls(self) -> int: ...

    @property
    def syncfs_failures(self) -> int: ...


class IndexWriteCounts(Protocol):
    """What :class:`AppendCounters` reads of the node's deferred index writes (a ``FlushedIndexWrites``)."""

    @property
    def writes(self) -> int: ...


class AppendCounters(Collector):
    """``waltz_storage_appended_records``, ``_appended_bytes`` and ``_fsyncs``, read from the partitions'
    plain counts when scraped. A prometheus Counter takes a lock and a few calls per update: three per group
    commit were the largest part of the metrics' cost on the path of a lone append."""

    def __init__(
        self,
        partitions: Callable[[], Sequence[PartitionCounters]],
        handoffs: HandoffCounts | None = None,
        index_writes: IndexWriteCounts | None = None,
    ) -> None:
        self._partitions = partitions
        self._handoffs = handoffs
        self._index_writes = index_writes

    def collect(self) -> Iterable[Metric]:
        records = CounterMetricFamily(
            "waltz_storage_appended_records", "Records appended", labels=["partition"]
        )
        data = CounterMetricFamily(
            "waltz_storage_appended_bytes", "Data bytes of records appended", labels=["partition"]
        )
        extending = CounterMetricFamily(
            "waltz_storage_extending_writes",
            "Group writes that reached past the data file's fsynced zeros (each of them with "
            "storage.segment.preallocateBytes 0): their fsync also commits the file's new size",
            labels=["partition"],
        )
        fsyncs = threaded = zero_bytes = zero_failures = 0
        for p in self._partitions():
            records.add_metric([str(p.partition_id)], p.appended_records)
            data.add_metric([str(p.partition_id)], p.appended_bytes)
            extending.add_metric([str(p.partition_id)], p.extending_writes)
            fsyncs += p.fsync_count
            threaded += p.threaded_fsync_count
            zero_bytes += p.preallocated_bytes
            zero_failures += p.preallocate_failures
        yield records
        yield data
        yield extending
        yield CounterMetricFamily(
            "waltz_storage_preallocated_bytes",
            "Zeros written ahead of the newest segments' last records (made durable by the next group fsync)",
            value=zero_bytes,
        )
        yield CounterMetricFamily(
            "waltz_storage_preallocate_failures",
            "Writes of preallocated zeros that failed (a full disk): records are not affected",
            value=zero_failures,
        )
        yield CounterMetricFamily("waltz_storage_fsyncs", "Group-commit fsyncs", value=fsyncs)
        yield CounterMetricFamily(
            "waltz_storage_fsyncs_in_thread",
            "Group-commit fsyncs run in a thread (a slow disk, or other partitions busy), not on the loop",
            value=threaded,
        )
        if self._handoffs is not None:
            yield CounterMetricFamily(
                "waltz_storage_fsync_handoffs",
                "Jobs of group-commit fsyncs handed to a thread: each runs the fsyncs of every partition "
                "whose group waited for one, in turn",
                value=self._handoffs.handoffs,
            )
            yield CounterMetricFamily(
                "waltz_storage_fsync_syncfs",
                "syncfs calls that made a batch of group-commit fsyncs durable at once (storage.fsync."
                "syncfsMinFiles): each stands for the fsyncs of every file of its batch",
                value=self._handoffs.syncfs_calls,
            )
            yield CounterMetricFamily(
                "waltz_storage_fsync_syncfs_failures",
                "syncfs calls that failed: each file of their batch was then fsynced on its own",
                value=self._handoffs.syncfs_failures,
            )
        if self._index_writes is not None:
            yield CounterMetricFamily(
                "waltz_storage_index_writes",
                "Writes of the index entries of fsynced records, made at most "
                f"{FLUSHED_INDEX_DELAY_S * 1000:g} ms after their group fsyncs: one per partition per "
                "interval, for every group of that interval",
                value=self._index_writes.writes,
            )


def directory_bytes(directory: str) -> int:
    """Total size of the files under ``directory`` (read when /metrics is scraped: a few dozen files per
    partition, so cheap next to a scrape interval)."""
    total = 0
    stack = [directory]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue  # removed while we looked
    return total


def free_bytes(directory: str) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0
