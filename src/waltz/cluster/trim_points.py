"""TrimPoints: each partition's trim point, at ``<root>/store/trim`` (created by the first trim).

The trim point of a partition is the lowest transaction id still readable; every id below it was deleted
on purpose (``docs/operations.md``, "Retention"). A partition not listed has trim point 0 (nothing trimmed).

Encoding (big-endian, see :mod:`waltz.cluster.codec`)::

    u8   format version   (1)
    i32  n                number of partitions listed
    n x:
        i32  partition id           (ascending, each once)
        i64  trim point             (> 0)
        i64  set at, ms since the epoch

Written by :func:`raise_trim_point` only (``waltz cluster trim``), with a version check, so two trims racing
never lose one; a trim point only moves up. Servers watch the znode and send each owned partition's trim point
to its replicas (storage ``TrimRequest``), which record it in their control files and delete what is below.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kazoo.client import KazooClient

from waltz.cluster.codec import Reader, Writer
from waltz.cluster.zk import ClusterPaths, compare_and_set, zk_errors
from waltz.errors import MetadataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

DEFAULT_MIN_KEPT_TRANSACTIONS = 1000
"""The grace a trim leaves by default: the most recent transactions it never removes."""


@dataclass(frozen=True)
class TrimEntry:
    trim_point: int
    set_at_ms: int


@dataclass(frozen=True)
class TrimPoints:
    """Partition id -> its trim point (partitions not listed: 0)."""

    entries: Mapping[int, TrimEntry] = field(default_factory=dict)

    def of(self, partition_id: int) -> int:
        entry = self.entries.get(partition_id)
        return entry.trim_point if entry is not None else 0

    def encode(self) -> bytes:
        w = Writer().u8(FORMAT_VERSION).i32(len(self.entries))
        for pid in sorted(self.entries):
            e = self.entries[pid]
            w.i32(pid).i64(e.trim_point).i64(e.set_at_ms)
        return w.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> TrimPoints:
        r = Reader(raw, "trim points")
        r.version(FORMAT_VERSION)
        entries: dict[int, TrimEntry] = {}
        for _ in range(r.count()):
            pid, trim, at = r.i32(), r.i64(), r.i64()
            if pid in entries or pid < 0 or trim <= 0:
                raise MetadataError(f"trim points: bad entry for partition {pid} (trim point {trim})")
            entries[pid] = TrimEntry(trim, at)
        r.finish()
        return cls(entries)


@dataclass(frozen=True)
class TrimOutcome:
    """What :func:`raise_trim_point` did: the trim point before and after, and one line saying so."""

    before: int
    after: int
    message: str


def read_trim_points(client: KazooClient, root: str) -> TrimPoints:
    """The cluster's trim points (empty if no partition was ever trimmed)."""
    path = ClusterPaths(root).trim_points
    with zk_errors("trim points"):
        if client.exists(path) is None:
            return TrimPoints()
        raw, _ = client.get(path)
    return TrimPoints.decode(raw)


def trim_refusal(
    partition_id: int, target: int, high_water_mark: int, min_kept_transactions: int
) -> str | None:
    """Why trimming ``partition_id`` to ``target`` is refused (bad input; nothing changes), or None."""
    if target < 0:
        return f"partition {partition_id}: trim point {target} is negative"
    if target > high_water_mark + 1:
        return (
            f"partition {partition_id}: trim point {target} is above the high-water mark {high_water_mark} "
            f"+ 1: only committed transactions can be trimmed"
        )
    limit = high_water_mark + 1 - min_kept_transactions
    if target > limit:
        return (
            f"partition {partition_id}: trim point {target} would keep fewer than the "
            f"{min_kept_transactions} most recent transactions retention.minKeptTransactions keeps "
            f"(high-water mark {high_water_mark}; the highest trim point allowed now is {max(limit, 0)})"
        )
    return None


def raise_trim_point(
    client: KazooClient,
    root: str,
    partition_id: int,
    target: int,
    high_water_mark: int,
    *,
    min_kept_transactions: int,
    clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
) -> TrimOutcome:
    """Raise a partition's trim point to ``target`` (version-checked); a target at or below the current one
    is a no-op, said so. Raises MetadataError (naming the partition) for a target the rules refuse
    (:func:`trim_refusal`) and nothing is written."""
    refusal = trim_refusal(partition_id, target, high_water_mark, min_kept_transactions)
    if refusal is not None:
        raise MetadataError(refusal)
    path = ClusterPaths(root).trim_points
    with zk_errors("trim points"):
        client.ensure_path(path)
    seen: list[int] = []

    def update(current: TrimPoints | None) -> bytes | None:
        points = current if current is not None else TrimPoints()
        seen.append(points.of(partition_id))
        if target <= points.of(partition_id):
            return None
        entries = dict(points.entries)
        entries[partition_id] = TrimEntry(target, clock_ms())
        return TrimPoints(entries).encode()

    compare_and_set(client, path, _decode_or_empty, update, "trim points")
    before = seen[-1]
    if target <= before:
        return TrimOutcome(
            before,
            before,
            f"partition {partition_id}: already trimmed to {before}; nothing to do for {target}",
        )
    log.info("partition %d: trim point raised from %d to %d", partition_id, before, target)
    return TrimOutcome(
        before, target, f"partition {partition_id}: trim point raised from {before} to {target}"
    )


def _decode_or_empty(raw: bytes) -> TrimPoints:
    return TrimPoints.decode(raw) if raw else TrimPoints()
