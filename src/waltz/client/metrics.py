"""The client's Prometheus metrics, in a registry the application chooses (``metrics_registry=``).

Off by default: a client made without ``metrics_registry`` counts nothing (one ``is None`` check per committed
append). With a registry (``prometheus_client.REGISTRY`` to join the application's own ``/metrics``, or one
of its own), the client registers :class:`ClientMetrics` when it starts and removes it when it closes; one
client per registry (a second one's names would collide: :class:`~waltz.errors.ClientError`).

What is counted where the client already keeps books, in plain numbers (:class:`PartitionCounts`):

* a committed append's latency, in ``_resolve`` (the client's one place a commit is heard): the time since
  its context was made (``TransactionContext.creation_time``, where ``client.transactionTimeout`` starts),
  retries and waits for a slot included: what the application waits for;
* an append that did not commit (lock conflict or lost) and sent its context to the retry path;
* a context ended by an exception (expired, ``execute`` raised, the partition released, the client closed);
* an ``apply_transaction`` that raised; a mount that became READY.

Everything else is read when scraped, from the state the client keeps anyway: the mount state, the applied
and fed high-water marks and the lag between them, a stuck partition, contexts in flight, and the client's
ZooKeeper session (``waltz_zookeeper_*``, network driver only).

Single event loop: the counts change on the client's loop; a scrape reads them from another thread, which
may see one in the middle of an update (a histogram's count one ahead of its sum), never a torn number.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from waltz.client.driver import MountState
from waltz.client.monitor import Outcome
from waltz.client.state import PartitionState
from waltz.errors import ClientError

__all__ = ["SUBMIT_SECONDS_BOUNDS", "ClientMetrics", "PartitionCounts"]

SUBMIT_SECONDS_BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of ``waltz_client_submit_seconds``' buckets."""

MOUNT_STATES = ("mounting", "ready", "not_ready", "client_ahead", "failed")
"""The values of ``waltz_client_mount_state``'s ``state`` label: asking the application for its high-water
mark or waiting for the server's first answer, a MountState, or ended by an error (released, trimmed, the
client closed)."""

_STATE_NAMES = {
    MountState.READY: "ready",
    MountState.NOT_READY: "not_ready",
    MountState.CLIENT_AHEAD: "client_ahead",
}
_RETRY_REASONS = {Outcome.LOCK_FAILED: "lock", Outcome.FAILED: "lost"}


class PartitionCounts:
    """One partition's counters (plain numbers, changed on the client's loop), kept for the client's life:
    they outlive a release and a new mount of the partition, so they only grow."""

    __slots__ = ("apply_failures", "failed_contexts", "latency_counts", "latency_sum", "mounts", "retries")

    def __init__(self) -> None:
        self.retries = dict.fromkeys(_RETRY_REASONS.values(), 0)
        self.failed_contexts = 0
        self.apply_failures = 0
        self.mounts = 0
        self.latency_counts = [0] * (len(SUBMIT_SECONDS_BOUNDS) + 1)  # The last one: above every bound.
        self.latency_sum = 0.0


class ClientMetrics(Collector):
    """The client's ``waltz_client_*`` families (see the module docstring and docs/operations.md)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        partitions: Callable[[], Mapping[int, PartitionState]],
    ) -> None:
        self._registry = registry
        self._partitions = partitions
        self._counts: dict[int, PartitionCounts] = {}
        self._registered = False
        self._zk_collector: Collector | None = None

    # -- life cycle --------------------------------------------------------------------------------------

    def register(self, zookeeper: Callable[[], Any] | None = None) -> None:
        """Add the client's families to the registry (at start), and ``waltz_zookeeper_*`` of the kazoo
        client ``zookeeper()`` returns (the network driver's) unless the registry has them already."""
        try:
            self._registry.register(self)
        except ValueError as e:
            raise ClientError(
                f"metrics_registry already holds a Waltz client's metrics (one client per registry): {e}"
            ) from None
        self._registered = True
        if zookeeper is not None:
            from waltz.cluster.zk_metrics import ZooKeeperCollector  # Loads kazoo: network driver only.

            collector = ZooKeeperCollector(zookeeper)
            try:
                self._registry.register(collector)
            except ValueError:
                return  # Another Waltz component of this process exports its session there.
            self._zk_collector = collector

    def unregister(self) -> None:
        """Remove them (at close), so a closed client leaves no stale series."""
        if not self._registered:
            return
        self._registered = False
        self._registry.unregister(self)
        if self._zk_collector is not None:
            self._registry.unregister(self._zk_collector)
            self._zk_collector = None

    # -- counted on the loop -----------------------------------------------------------------------------

    def partition(self, partition_id: int) -> PartitionCounts:
        counts = self._counts.get(partition_id)
        if counts is None:
            counts = self._counts[partition_id] = PartitionCounts()
        return counts

    def committed(self, partition_id: int, created_s: list[float]) -> None:
        """Appends committed (the ones of a feed run); their contexts were made at ``created_s`` (wall clock).
        One clock read for them all."""
        counts = self._counts.get(partition_id) or self.partition(partition_id)
        now = time.time()
        buckets = counts.latency_counts
        bucket_of = bisect.bisect_left
        total = 0.0
        for created in created_s:
            seconds = now - created
            buckets[bucket_of(SUBMIT_SECONDS_BOUNDS, seconds)] += 1
            total += seconds
        counts.latency_sum += total

    def retried(self, partition_id: int, outcome: Outcome) -> None:
        reason = _RETRY_REASONS.get(outcome)
        if reason is not None:
            self.partition(partition_id).retries[reason] += 1

    def context_failed(self, partition_id: int) -> None:
        self.partition(partition_id).failed_contexts += 1

    def apply_failed(self, partition_id: int) -> None:
        self.partition(partition_id).apply_failures += 1

    def mounted(self, partition_id: int) -> None:
        self.partition(partition_id).mounts += 1

    # -- read when scraped -------------------------------------------------------------------------------

    def describe(self) -> list[Metric]:
        # The names, for the registry's duplicate check (a second client in the same registry).
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        mounted = dict(self._partitions())  # Copied: the loop may change the dict while a scrape reads it.
        for pid in mounted:
            self.partition(pid)  # Series for every mounted partition, at 0 until something happens.
        yield from self._gauges(mounted)
        yield from self._counters()

    def _gauges(self, mounted: dict[int, PartitionState]) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "waltz_client_mount_state",
            "1 for the partition's mount state now, 0 for the others",
            labels=["partition", "state"],
        )
        applied = GaugeMetricFamily(
            "waltz_client_applied_high_water_mark",
            "Last transaction the application applied (or skipped); -1 before the mount",
            labels=["partition"],
        )
        fed = GaugeMetricFamily(
            "waltz_client_feed_high_water_mark",
            "Last committed transaction the feed delivered to this client; -1 before the mount",
            labels=["partition"],
        )
        lag = GaugeMetricFamily(
            "waltz_client_apply_lag",
            "Transactions delivered by the feed and not applied yet",
            labels=["partition"],
        )
        stuck = GaugeMetricFamily(
            "waltz_client_partition_stuck",
            "1 while apply_transaction keeps failing on one transaction (the partition's feed waits)",
            labels=["partition"],
        )
        in_flight = GaugeMetricFamily(
            "waltz_client_transactions_in_flight",
            "Contexts holding one of the partition's client.maxConcurrentTransactions slots",
            labels=["partition"],
        )
        for pid, partition in sorted(mounted.items()):
            p = str(pid)
            current = _state_name(partition)
            for name in MOUNT_STATES:
                state.add_metric([p, name], 1 if name == current else 0)
            monitor = partition.monitor
            applied_hwm = -1 if monitor is None else monitor.applied_high_water_mark
            fed_hwm = -1 if monitor is None else monitor.feed_high_water_mark
            applied.add_metric([p], applied_hwm)
            fed.add_metric([p], fed_hwm)
            lag.add_metric([p], max(0, fed_hwm - applied_hwm))
            stuck.add_metric([p], 0 if partition.stuck is None else 1)
            in_flight.add_metric([p], partition.slots.used)
        yield from (state, applied, fed, lag, stuck, in_flight)

    def _counters(self) -> Iterator[Metric]:
        retries = CounterMetricFamily(
            "waltz_client_retries",
            "Appends that did not commit and sent their context to the retry path: a lock conflict (lock) "
            "or lost (lost: the server failed it, moved, or the connection dropped)",
            labels=["partition", "reason"],
        )
        failed = CounterMetricFamily(
            "waltz_client_failed_contexts",
            "Contexts ended by an exception (on_exception): expired, execute raised, released, closed",
            labels=["partition"],
        )
        apply_failures = CounterMetricFamily(
            "waltz_client_apply_failures", "apply_transaction calls that raised", labels=["partition"]
        )
        mounts = CounterMetricFamily(
            "waltz_client_mounts",
            "Mounts that became READY (the first one, and every remount)",
            labels=["partition"],
        )
        latency = HistogramMetricFamily(
            "waltz_client_submit_seconds",
            "Time from a context's creation to its append committed, retries and waits included",
            labels=["partition"],
        )
        for pid, counts in sorted(self._counts.items()):
            p = str(pid)
            for reason, n in counts.retries.items():
                retries.add_metric([p, reason], n)
            failed.add_metric([p], counts.failed_contexts)
            apply_failures.add_metric([p], counts.apply_failures)
            mounts.add_metric([p], counts.mounts)
            latency.add_metric([p], _buckets(counts.latency_counts), counts.latency_sum)
        yield from (retries, failed, apply_failures, mounts, latency)


def _state_name(partition: PartitionState) -> str:
    if partition.error is not None:
        return "failed"
    if partition.monitor is None or partition.state is None:
        return "mounting"
    return _STATE_NAMES[partition.state]


def _buckets(counts: list[int]) -> list[tuple[str, float]]:
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip(SUBMIT_SECONDS_BOUNDS, counts, strict=False):
        total += n
        buckets.append((repr(bound), total))
    buckets.append(("+Inf", total + counts[-1]))
    return buckets
