"""Offsets, range planning and admission control for the ``waltz`` source: pure functions, no Spark.

Offsets
    A streaming offset is the JSON object ``{"v": 1, "cluster": "<name>", "partitions": {"0": 1200, ...}}``.
    A partition's value is the id of the **next** transaction to read, so the range of a micro-batch is the
    half-open ``[previous, this)``, as in Kafka. Partition keys are decimal strings in ascending numeric
    order, so equal offsets always serialise to equal text. ``v`` lets the format evolve (a reader rejects
    versions it does not know); ``cluster`` makes a checkpoint taken on one log fail loudly on another.

Invariants the planner keeps (and the tests pin):

* An offset never moves backwards, and never past ``high-water mark + 1`` (only committed transactions,
  which never change, are planned; so a replay of batch N after a crash reads exactly what batch N read).
* A planned range is never empty; ``start == end`` plans nothing.
* Under a row limit, a micro-batch admits at most ``limit`` transactions, shared between partitions in
  proportion to their backlog (largest remainders first), and at least one when anything is pending.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
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
    "resolve_batch_ranges",
    "resolve_start",
    "split_ranges",
]

log = logging.getLogger(__name__)

OFFSET_VERSION = 1


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

    def to_json(self) -> dict[str, Any]:
        return {
            "v": OFFSET_VERSION,
            "cluster": self.cluster,
            "partitions": {str(p): self.partitions[p] for p in sorted(self.partitions)},
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any], expected_cluster: str | None = None) -> WaltzOffset:
        """Parse an offset Spark read back from a checkpoint; raise ConfigError if it is not ours."""
        if not isinstance(value, Mapping):
            raise ConfigError(f"waltz offset: expected a JSON object, got {value!r}")
        version = value.get("v")
        if version != OFFSET_VERSION:
            raise ConfigError(
                f"waltz offset: version {version!r} is not supported (this reader knows v{OFFSET_VERSION}); "
                "was the checkpoint written by a newer waltz?"
            )
        cluster = value.get("cluster")
        raw = value.get("partitions")
        if not isinstance(cluster, str) or not isinstance(raw, Mapping):
            raise ConfigError(f"waltz offset: malformed {dict(value)!r}")
        if expected_cluster is not None and cluster != expected_cluster:
            raise ConfigError(
                f"waltz offset: the checkpoint belongs to cluster {cluster!r} but this query reads "
                f"{expected_cluster!r}; use a new checkpoint location for a different log"
            )
        partitions: dict[int, int] = {}
        for key, next_id in raw.items():
            if isinstance(next_id, bool) or not isinstance(next_id, int) or next_id < 0:
                raise ConfigError(f"waltz offset: partition {key!r}: bad position {next_id!r}")
            partitions[int(key)] = next_id
        return cls(cluster, partitions)


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
    it. Not thread-safe: Spark calls a stream reader from one thread.
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
    ) -> None:
        self.source = source
        self.cluster = source.cluster_name
        self.partitions = selected_partitions(partitions, source.num_partitions)
        self.starting = starting
        self.fail_on_data_loss = fail_on_data_loss
        self.min_partitions = min_partitions
        self.max_records_per_partition = max_records_per_partition
        self._pinned: dict[int, int] | None = None  # Trigger.AvailableNow's target
        self._latest: dict[int, int] | None = None

    def _committed_ends(self) -> dict[int, int]:
        hwms = self.source.high_water_marks(self.partitions)
        self._latest = {p: hwms[p] + 1 for p in self.partitions}
        return hwms

    def initial_offset(self) -> dict[str, Any]:
        """Where a query with an empty checkpoint starts (``startingOffsets``)."""
        hwms = self._committed_ends()
        start = resolve_start(self.starting, self.partitions, hwms, self.fail_on_data_loss)
        return WaltzOffset(self.cluster, start).to_json()

    def _parse(self, offset: Mapping[str, Any]) -> dict[int, int]:
        parsed = WaltzOffset.from_json(offset, self.cluster).partitions
        # A partition added to the selection since the checkpoint starts at its beginning.
        return {p: parsed.get(p, 0) for p in self.partitions}

    def prepare_available_now(self) -> None:
        """Pin the target of a ``Trigger.AvailableNow`` run to the committed log as it is now."""
        hwms = self._committed_ends()
        self._pinned = {p: hwms[p] + 1 for p in self.partitions}

    def latest_offset(self, start: Mapping[str, Any], max_rows: int | None) -> dict[str, Any]:
        """The end of the next micro-batch: committed, never behind ``start``, at most ``max_rows`` ahead."""
        begin = self._parse(start)
        if self._pinned is not None:
            target = {p: max(begin[p], self._pinned[p]) for p in self.partitions}
        else:
            hwms = self._committed_ends()
            target = advance(begin, hwms, self.fail_on_data_loss)
        end = admit(begin, target, max_rows)
        return WaltzOffset(self.cluster, end).to_json()

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
        """The committed ends seen last (shown as ``latestOffset`` in query progress, so lag is visible)."""
        if self._latest is None:
            return None
        return WaltzOffset(self.cluster, self._latest).to_json()
