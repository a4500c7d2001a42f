"""Offsets, range planning and admission control for the ``waltz`` source: pure functions, no Spark.

Offsets
    A streaming offset is the JSON object
    ``{"v": 2, "cluster": "<name>", "clusterKey": "<uuid>", "partitions": {"0": 1200, ...}}``.
    A partition's value is the id of the **next** transaction to read, so the range of a micro-batch is the
    half-open ``[previous, this)``, as in Kafka. Partition keys are decimal strings in ascending numeric
    order, so equal offsets always serialise to equal text. ``v`` lets the format evolve (a reader rejects
    versions it does not know); ``clusterKey``, the log's UUID chosen when the cluster was created, makes a
    checkpoint taken on one log fail loudly on another, even one with the same name (every ``waltz local``
    cluster is called ``local``). Offsets of format v1 (name only) are still read, with a warning.

Invariants the planner keeps (and the tests pin):

* An offset never moves backwards, and never past ``high-water mark + 1`` (only committed transactions,
  which never change, are planned; so a replay of batch N after a crash reads exactly what batch N read).
* A planned range is never empty; ``start == end`` plans nothing.
* Under a row limit, a micro-batch admits at most ``limit`` transactions, shared between partitions in
  proportion to their backlog (largest remainders first), and at least one when anything is pending.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from waltz.errors import ClientError, ConfigError
from waltz.spark.options import EARLIEST, LATEST, OffsetSpec
from waltz.spark.source import LogSource

__all__ = [
    "OFFSET_VERSION",
    "DataLossError",
    "StreamPlanner",
    "TxnRange",
    "WaltzOffset",
    "admit",
    "progress_lag",
    "resolve_batch_ranges",
    "resolve_start",
    "split_ranges",
]

log = logging.getLogger(__name__)

OFFSET_VERSION = 2


class DataLossError(ClientError):
    """An offset points past the committed log (a restored or different log): with ``failOnDataLoss``."""


@dataclass(frozen=True, slots=True)
class TxnRange:
    """Transactions ``[start, end)`` of one partition: one Spark task."""

    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class WaltzOffset:
    """A position in every selected partition: the next transaction id to read (see the module docstring)."""

    cluster: str
    partitions: Mapping[int, int]
    cluster_key: str | None = None
    """The log's identity (its cluster key, a UUID); None only in offsets of format v1."""

    def to_json(self) -> dict[str, Any]:
        return {
            "v": OFFSET_VERSION,
            "cluster": self.cluster,
            "clusterKey": self.cluster_key,
            "partitions": {str(p): self.partitions[p] for p in sorted(self.partitions)},
        }

    @classmethod
    def from_json(
        cls,
        value: Mapping[str, Any],
        expected_cluster: str | None = None,
        expected_key: str | None = None,
    ) -> WaltzOffset:
        """Parse an offset Spark read back from a checkpoint; raise ConfigError if it is not ours.

        An offset of format v2 must carry ``expected_key`` (when given): a checkpoint of another log, even
        one with the same cluster name (every ``waltz local`` cluster is named ``local``), is refused. An
        offset of format v1 (no key) is still read, matched by cluster name only, with a warning.
        """
        if not isinstance(value, Mapping):
            raise ConfigError(f"waltz offset: expected a JSON object, got {value!r}")
        version = value.get("v")
        if version not in (1, OFFSET_VERSION):
            raise ConfigError(
                f"waltz offset: version {version!r} is not supported (this reader knows v1 and "
                f"v{OFFSET_VERSION}); was the checkpoint written by a newer waltz?"
            )
        cluster = value.get("cluster")
        key = value.get("clusterKey") if version == OFFSET_VERSION else None
        raw = value.get("partitions")
        if (
            not isinstance(cluster, str)
            or not isinstance(raw, Mapping)
            or (version == OFFSET_VERSION and not isinstance(key, str))
        ):
            raise ConfigError(f"waltz offset: malformed {dict(value)!r}")
        if expected_key is not None and key is not None and key != expected_key:
            raise ConfigError(
                f"waltz offset: the checkpoint belongs to another log (cluster {cluster!r}, cluster key "
                f"{key}) but this query reads cluster {expected_cluster or '?'!r} with cluster key "
                f"{expected_key}; use a new checkpoint location for a different log"
            )
        if expected_cluster is not None and cluster != expected_cluster:
            raise ConfigError(
                f"waltz offset: the checkpoint belongs to cluster {cluster!r} but this query reads "
                f"{expected_cluster!r}; use a new checkpoint location for a different log"
            )
        if version == 1:
            _warn_v1(cluster)
        partitions: dict[int, int] = {}
        for k, next_id in raw.items():
            if isinstance(next_id, bool) or not isinstance(next_id, int) or next_id < 0:
                raise ConfigError(f"waltz offset: partition {k!r}: bad position {next_id!r}")
            partitions[int(k)] = next_id
        return cls(cluster, partitions, key)


_warned_v1: set[str] = set()


def _warn_v1(cluster: str) -> None:
    # Once per process and cluster: Spark parses the same checkpointed offset at every micro-batch.
    if cluster not in _warned_v1:
        _warned_v1.add(cluster)
        log.warning(
            "waltz offset: the checkpoint has v1 offsets, which name the log by cluster name (%r) only; a "
            "checkpoint of another log with the same name cannot be told apart. New offsets are written "
            "as v%d with the cluster key",
            cluster,
            OFFSET_VERSION,
        )


def resolve_start(
    spec: OffsetSpec, partitions: Sequence[int], hwms: Mapping[int, int], fail_on_data_loss: bool
) -> dict[int, int]:
    """The first transaction id to read per partition, for a ``startingOffsets`` spec."""
    out: dict[int, int] = {}
    for p in partitions:
        committed = hwms[p] + 1
        wanted: int = EARLIEST
        if spec == "latest":
            wanted = LATEST
        elif isinstance(spec, dict):
            wanted = spec.get(p, EARLIEST)
        if wanted == EARLIEST:
            out[p] = 0
        elif wanted == LATEST:
            out[p] = committed
        elif wanted > committed:
            _data_loss(
                fail_on_data_loss,
                f"partition {p}: startingOffsets {wanted} is past the committed log "
                f"({committed} transactions)",
            )
            out[p] = committed
        else:
            out[p] = wanted
    return out


def resolve_batch_ranges(
    starting: OffsetSpec,
    ending: OffsetSpec,
    partitions: Sequence[int],
    hwms: Mapping[int, int],
    fail_on_data_loss: bool,
) -> list[TxnRange]:
    """The ranges of a batch read; every end is at most the committed high-water mark + 1."""
    start = resolve_start(starting, partitions, hwms, fail_on_data_loss)
    ranges: list[TxnRange] = []
    for p in partitions:
        committed = hwms[p] + 1
        wanted = ending.get(p, LATEST) if isinstance(ending, dict) else LATEST
        end = committed if wanted == LATEST else wanted
        if end > committed:
            _data_loss(
                fail_on_data_loss,
                f"partition {p}: endingOffsets {end} is past the committed log ({committed} transactions); "
                "only committed transactions can be read",
            )
            end = committed
        if start[p] < end:
            ranges.append(TxnRange(p, start[p], end))
    return ranges


def split_ranges(
    ranges: Sequence[TxnRange], min_partitions: int | None, max_records: int | None
) -> list[TxnRange]:
    """Split ranges into Spark tasks, as Kafka's ``KafkaOffsetRangeCalculator`` does.

    With ``min_partitions`` above the number of ranges, each range gets a share of that many tasks in
    proportion to its size (at least one); then ``max_records`` caps every task. Pieces are contiguous,
    cover each range exactly and differ in size by at most one.
    """
    ranges = [r for r in ranges if r.size > 0]
    out: list[TxnRange] = []
    total = sum(r.size for r in ranges)
    for r in ranges:
        pieces = 1
        if min_partitions is not None and len(ranges) < min_partitions and total > 0:
            pieces = max(1, round(r.size / total * min_partitions))
        if max_records is not None:
            pieces = max(pieces, math.ceil(r.size / max_records))
        pieces = min(pieces, r.size)
        base, extra = divmod(r.size, pieces)
        pos = r.start
        for i in range(pieces):
            step = base + (1 if i < extra else 0)
            out.append(TxnRange(r.partition, pos, pos + step))
            pos += step
    return out


def admit(start: Mapping[int, int], available: Mapping[int, int], max_rows: int | None) -> dict[int, int]:
    """The end offset of a micro-batch that admits at most ``max_rows`` transactions (None: all).

    The limit is shared in proportion to each partition's backlog, by the largest-remainder method, so the
    batch holds exactly ``min(max_rows, backlog)`` transactions and partitions are served fairly.
    """
    backlog = {p: max(0, available[p] - start[p]) for p in start}
    total = sum(backlog.values())
    if max_rows is None or total <= max_rows:
        return {p: start[p] + backlog[p] for p in start}
    shares: dict[int, int] = {}
    remainders: list[tuple[float, int]] = []
    for p, pending in backlog.items():
        exact = max_rows * pending / total
        shares[p] = math.floor(exact)
        remainders.append((exact - shares[p], p))
    left = max_rows - sum(shares.values())
    for _, p in sorted(remainders, key=lambda item: (-item[0], item[1]))[:left]:
        shares[p] += 1
    return {p: start[p] + min(shares[p], backlog[p]) for p in start}


def advance(start: Mapping[int, int], hwms: Mapping[int, int], fail_on_data_loss: bool) -> dict[int, int]:
    """Per partition, the committed end (hwm + 1) but never behind ``start``: offsets do not move back.

    A start past the committed log means the log lost transactions since they were read (a restored
    storage directory) or the checkpoint is from another log: DataLossError, or a warning without
    ``failOnDataLoss`` (and the offset stays where it is until the log catches up).
    """
    out: dict[int, int] = {}
    for p, pos in start.items():
        committed = hwms[p] + 1
        if committed < pos:
            _data_loss(
                fail_on_data_loss,
                f"partition {p}: the checkpoint is at transaction {pos} but the log has only {committed} "
                "committed transactions (restored log, or a checkpoint of another log?)",
            )
        out[p] = max(pos, committed)
    return out


def _data_loss(fail: bool, message: str) -> None:
    if fail:
        raise DataLossError(message + "; set failOnDataLoss=false to continue anyway")
    log.warning("waltz data source: %s; continuing (failOnDataLoss=false)", message)


def selected_partitions(requested: Sequence[int] | None, num_partitions: int) -> list[int]:
    """The partitions a query reads: ``requested`` (checked against the cluster) or all of them."""
    if requested is None:
        return list(range(num_partitions))
    bad = [p for p in requested if p >= num_partitions]
    if bad:
        raise ConfigError(
            f"waltz data source: partitions {bad} do not exist (the cluster has {num_partitions} partitions)"
        )
    return list(requested)


class StreamPlanner:
    """The state and decisions of a streaming read, independent of Spark (see the module docstring).

    One instance lives in Spark's long-running driver-side source process; ``WaltzStreamReader`` forwards to
    it. Not thread-safe: Spark calls a stream reader from one thread. ``clock`` (monotonic seconds) is
    injected so that ``minOffsetsPerTrigger`` / ``maxTriggerDelay`` are tested without waiting.
    """

    def __init__(
        self,
        source: LogSource,
        *,
        partitions: Sequence[int] | None,
        starting: OffsetSpec,
        fail_on_data_loss: bool,
        min_partitions: int | None = None,
        max_records_per_partition: int | None = None,
        min_offsets_per_trigger: int | None = None,
        max_trigger_delay_ms: int = 15 * 60 * 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.cluster = source.cluster_name
        self.cluster_key = source.cluster_key
        self.partitions = selected_partitions(partitions, source.num_partitions)
        self.starting = starting
        self.fail_on_data_loss = fail_on_data_loss
        self.min_partitions = min_partitions
        self.max_records_per_partition = max_records_per_partition
        self.min_offsets_per_trigger = min_offsets_per_trigger
        self.max_trigger_delay_s = max_trigger_delay_ms / 1000
        self._clock = clock
        self._last_trigger_s = clock()
        self._pinned: dict[int, int] | None = None  # Trigger.AvailableNow's target
        self._latest: dict[int, int] | None = None  # committed ends, as last read
        self._planned: dict[int, int] | None = None  # end of the last micro-batch latest_offset returned

    def _offset(self, positions: Mapping[int, int]) -> dict[str, Any]:
        return WaltzOffset(self.cluster, positions, self.cluster_key).to_json()

    def _committed_ends(self) -> dict[int, int]:
        hwms = self.source.high_water_marks(self.partitions)
        self._latest = {p: hwms[p] + 1 for p in self.partitions}
        return hwms

    def initial_offset(self) -> dict[str, Any]:
        """Where a query with an empty checkpoint starts (``startingOffsets``)."""
        hwms = self._committed_ends()
        start = resolve_start(self.starting, self.partitions, hwms, self.fail_on_data_loss)
        return self._offset(start)

    def _parse(self, offset: Mapping[str, Any]) -> dict[int, int]:
        parsed = WaltzOffset.from_json(offset, self.cluster, self.cluster_key).partitions
        # A partition added to the selection since the checkpoint starts at its beginning.
        return {p: parsed.get(p, 0) for p in self.partitions}

    def prepare_available_now(self) -> None:
        """Pin the target of a ``Trigger.AvailableNow`` run to the committed log as it is now."""
        hwms = self._committed_ends()
        self._pinned = {p: hwms[p] + 1 for p in self.partitions}

    def latest_offset(self, start: Mapping[str, Any], max_rows: int | None) -> dict[str, Any]:
        """The end of the next micro-batch: committed, never behind ``start``, at most ``max_rows`` ahead.

        A start past the committed log is data loss under every trigger (``failOnDataLoss``), including
        ``Trigger.AvailableNow``, whose target is the log pinned when the run started. With
        ``minOffsetsPerTrigger`` (not under AvailableNow, as in Kafka) a micro-batch waits until that many
        transactions are pending or ``maxTriggerDelay`` has passed since the last one: until then the end is
        the start, which Spark treats as "no new data".
        """
        begin = self._parse(start)
        if self._pinned is not None:
            target = advance(begin, {p: self._pinned[p] - 1 for p in self.partitions}, self.fail_on_data_loss)
        else:
            hwms = self._committed_ends()
            target = advance(begin, hwms, self.fail_on_data_loss)
        end = admit(begin, target, max_rows)
        pending = sum(end[p] - begin[p] for p in self.partitions)
        if self._pinned is None and self.min_offsets_per_trigger is not None and pending > 0:
            waited_s = self._clock() - self._last_trigger_s
            if pending < self.min_offsets_per_trigger and waited_s < self.max_trigger_delay_s:
                end = dict(begin)
                pending = 0
        if pending > 0:
            self._last_trigger_s = self._clock()
        self._planned = end
        return self._offset(end)

    def plan(self, start: Mapping[str, Any], end: Mapping[str, Any]) -> list[TxnRange]:
        """The tasks of the micro-batch ``[start, end)``; ``[]`` when they are equal."""
        begin = self._parse(start)
        finish = self._parse(end)
        ranges = []
        for p in self.partitions:
            if finish[p] < begin[p]:
                raise ConfigError(f"waltz offset: partition {p} moves backwards ({begin[p]} -> {finish[p]})")
            if finish[p] > begin[p]:
                ranges.append(TxnRange(p, begin[p], finish[p]))
        return split_ranges(ranges, self.min_partitions, self.max_records_per_partition)

    def latest_reported(self) -> dict[str, Any] | None:
        """The committed ends seen last, and the lag: shown as ``latestOffset`` in the query's progress.

        ``lag`` is, per partition, how many committed transactions are behind the end of the micro-batch
        planned last (not yet in any batch), and ``lagTotal`` their sum: the Kafka source's "offsets behind
        latest". PySpark's Python API has no custom metrics for a source, so the lag travels in this report
        (``sources[i].latestOffset`` of ``StreamingQuery.lastProgress``; :func:`progress_lag` reads it).
        """
        if self._latest is None:
            return None
        report = self._offset(self._latest)
        if self._planned is not None:
            lag = {p: max(0, self._latest[p] - self._planned[p]) for p in self.partitions}
            report["lag"] = {str(p): lag[p] for p in sorted(lag)}
            report["lagTotal"] = sum(lag.values())
        return report


def progress_lag(progress: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The lag of the first ``waltz`` source in a ``StreamingQuery.lastProgress`` (or ``recentProgress``
    item): ``{"total": n, "partitions": {partition: n}}``, or None before the first report."""
    if not progress:
        return None
    for source in progress.get("sources", ()):
        raw = source.get("latestOffset")
        try:
            report = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            continue
        if isinstance(report, Mapping) and "lagTotal" in report:
            return {
                "total": report["lagTotal"],
                "partitions": {int(p): n for p, n in report.get("lag", {}).items()},
            }
    return None
