"""TrimPoints: each partition's trim point, at ``<root>/store/trim`` (created by the first trim).

The trim point of a partition is the lowest transaction id still readable; every id below it was deleted
on purpose (``docs/operations.md``, "Retention"). A partition not listed has trim point 0 (nothing trimmed).

A trim point is first **pending**: it is recorded with the time it takes effect (the time it was set plus the
cluster's grace, ``retention.graceMs`` in ``<root>/store/retention``, :mod:`waltz.cluster.retention`), and
only then is it **in force**: servers pass it to the replicas, which delete what is below it. Until then
nothing is deleted and reads below it work, so a trim set by mistake can be seen (``waltz cluster retention
show``) and cancelled (``waltz cluster trim --cancel``). With a grace of 0 a trim is in force at once. A
partition has at most one pending trim point: a higher one set meanwhile replaces it (and its grace starts
again: deletion is only ever delayed, never hastened). A pending trim point whose time has come is in force
for every reader (:meth:`TrimEntry.in_force`), whether or not a writer has folded it in yet.

Encoding (big-endian, see :mod:`waltz.cluster.codec`), format 2 (written only while a trim point is pending,
and only at cluster feature version 2 or above, :data:`PENDING_FEATURE_VERSION`; otherwise format 1)::

    u8   format version   (2; format 1, written by older versions, is read as trim points in force)
    i32  n                number of partitions listed
    n x:
        i32  partition id           (ascending, each once)
        i64  trim point in force    (>= 0)
        i64  set at, ms since the epoch (of the trim point in force; 0 if none)
        u8   1 if a trim point is pending, else 0; if 1:
            i64  pending trim point (> the trim point in force)
            i64  set at, ms since the epoch
            i64  takes effect at, ms since the epoch (>= set at)
            u8   set by: 1 an operator (``waltz cluster trim``), 2 an application (``client.trim``),
                 3 the retention policy (the owning server)

An entry with trim point 0 and nothing pending is not written. Format 1 entries are ``i32 partition id ·
i64 trim point (> 0) · i64 set at``. Written only by :func:`raise_trim_point` and
:func:`cancel_pending_trim`, with a version check, so two writers racing never lose one; the trim point in
force only moves up. Servers watch the znode and send each owned partition's trim point in force to its
replicas (storage ``TrimRequest``), and apply a pending one when its time comes.
"""

from __future__ import annotations

import datetime
import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from kazoo.client import KazooClient

from waltz.cluster.codec import Reader, Writer
from waltz.cluster.features import read_feature_version
from waltz.cluster.zk import ClusterPaths, compare_and_set, zk_errors
from waltz.errors import MetadataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2

PENDING_FEATURE_VERSION = 2
"""The cluster feature version (:mod:`waltz.cluster.features`) from which format 2, and so a pending trim
point, may be written: a Waltz 0.1.0 server reads format 1 only. Below it, trim points without a grace are
written in format 1 and a trim with a grace is refused, naming the fix."""

DEFAULT_MIN_KEPT_TRANSACTIONS = 1000
"""The head guard a trim leaves by default: the most recent transactions it never removes."""


def wall_clock_ms() -> int:
    """Milliseconds since the epoch (the clock pending trim points are compared with)."""
    return time.time_ns() // 1_000_000


def format_time_ms(ms: int) -> str:
    """``ms`` since the epoch as an ISO 8601 UTC time to the second, for messages."""
    at = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


class TrimSource(enum.IntEnum):
    """Who set a trim point."""

    OPERATOR = 1
    CLIENT = 2
    POLICY = 3

    @property
    def label(self) -> str:
        return {1: "an operator", 2: "an application", 3: "the retention policy"}[self.value]


@dataclass(frozen=True)
class PendingTrim:
    """A trim point that takes effect (is passed to the replicas) at ``effective_at_ms``."""

    trim_point: int
    set_at_ms: int
    effective_at_ms: int
    source: TrimSource


@dataclass(frozen=True)
class TrimEntry:
    trim_point: int
    """In force (as written; a pending one whose time has come is in force too, see :meth:`in_force`)."""
    set_at_ms: int
    pending: PendingTrim | None = None

    def in_force(self, now_ms: int) -> int:
        """The trim point in force at ``now_ms``."""
        p = self.pending
        return p.trim_point if p is not None and now_ms >= p.effective_at_ms else self.trim_point

    def settled(self, now_ms: int) -> TrimEntry:
        """This entry with a pending trim point whose time has come folded into the one in force."""
        p = self.pending
        if p is None or now_ms < p.effective_at_ms:
            return self
        return TrimEntry(p.trim_point, p.set_at_ms)

    @property
    def requested(self) -> int:
        """The highest trim point set: the pending one if any, else the one in force."""
        return self.pending.trim_point if self.pending is not None else self.trim_point


NO_TRIM = TrimEntry(0, 0)


@dataclass(frozen=True)
class TrimPoints:
    """Partition id -> its trim entry (partitions not listed: trim point 0, nothing pending)."""

    entries: Mapping[int, TrimEntry] = field(default_factory=dict)

    def of(self, partition_id: int) -> int:
        """The trim point in force as written (see :meth:`in_force` for one that counts pending ones)."""
        return self.entry(partition_id).trim_point

    def entry(self, partition_id: int) -> TrimEntry:
        return self.entries.get(partition_id, NO_TRIM)

    def in_force(self, partition_id: int, now_ms: int) -> int:
        """The trim point in force at ``now_ms``: a pending one whose time has come counts."""
        return self.entry(partition_id).in_force(now_ms)

    def with_entry(self, partition_id: int, entry: TrimEntry) -> TrimPoints:
        """These trim points with ``partition_id``'s entry replaced (dropped if it says nothing)."""
        entries = dict(self.entries)
        entries[partition_id] = entry
        if entry.trim_point == 0 and entry.pending is None:
            del entries[partition_id]
        return TrimPoints(entries)

    def next_change_ms(self) -> int | None:
        """When the earliest pending trim point takes effect (None if none is pending)."""
        times = [e.pending.effective_at_ms for e in self.entries.values() if e.pending is not None]
        return min(times) if times else None

    def encode(self) -> bytes:
        """Format 2 if a trim point is pending, else format 1 (what Waltz 0.1.0 reads: the same facts)."""
        if all(e.pending is None for e in self.entries.values()):
            w = Writer().u8(1).i32(len(self.entries))
            for pid in sorted(self.entries):
                w.i32(pid).i64(self.entries[pid].trim_point).i64(self.entries[pid].set_at_ms)
            return w.bytes()
        w = Writer().u8(FORMAT_VERSION).i32(len(self.entries))
        for pid in sorted(self.entries):
            e = self.entries[pid]
            w.i32(pid).i64(e.trim_point).i64(e.set_at_ms)
            if e.pending is None:
                w.u8(0)
            else:
                p = e.pending
                w.u8(1).i64(p.trim_point).i64(p.set_at_ms).i64(p.effective_at_ms).u8(p.source)
        return w.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> TrimPoints:
        r = Reader(raw, "trim points")
        version = r.version(1, FORMAT_VERSION)
        entries: dict[int, TrimEntry] = {}
        for _ in range(r.count()):
            pid, trim, at = r.i32(), r.i64(), r.i64()
            pending = _read_pending(r, pid, trim) if version >= 2 else None
            if pid in entries or pid < 0 or trim < 0 or (trim == 0 and pending is None):
                raise MetadataError(f"trim points: bad entry for partition {pid} (trim point {trim})")
            entries[pid] = TrimEntry(trim, at, pending)
        r.finish()
        return cls(entries)


def _read_pending(r: Reader, partition_id: int, trim_point: int) -> PendingTrim | None:
    flag = r.u8()
    if flag == 0:
        return None
    point, set_at, effective_at, source = r.i64(), r.i64(), r.i64(), r.u8()
    if flag != 1 or point <= trim_point or effective_at < set_at or source not in set(TrimSource):
        raise MetadataError(
            f"trim points: bad pending trim point for partition {partition_id} "
            f"({point}, set at {set_at}, effective at {effective_at}, source {source})"
        )
    return PendingTrim(point, set_at, effective_at, TrimSource(source))


@dataclass(frozen=True)
class TrimOutcome:
    """What :func:`raise_trim_point` did: the trim point before and the one set, and one line saying so."""

    before: int
    """The trim point requested before (pending or in force)."""
    after: int
    """The trim point requested now (``before`` for a no-op)."""
    message: str
    effective_at_ms: int = 0
    """When ``after`` takes effect: now for an immediate trim (no grace) or a no-op."""


def read_trim_points(client: KazooClient, root: str) -> TrimPoints:
    """The cluster's trim points (empty if no partition was ever trimmed)."""
    path = ClusterPaths(root).trim_points
    with zk_errors("trim points"):
        if client.exists(path) is None:
            return TrimPoints()
        raw, _ = client.get(path)
    return _decode_or_empty(raw)


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
            f"{min_kept_transactions} most recent transactions --min-kept keeps "
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
    grace_ms: int,
    source: TrimSource = TrimSource.OPERATOR,
    replace_pending: bool = True,
    clock_ms: Callable[[], int] = wall_clock_ms,
    feature_version: int | None = None,
) -> TrimOutcome:
    """Set a partition's trim point to ``target`` (version-checked): pending for ``grace_ms``, then in force
    (at once if ``grace_ms`` is 0). A target at or below the one requested is a no-op, said so, as is any
    target while a trim point is pending if ``replace_pending`` is False (the policy's way). Raises
    MetadataError (naming the partition) for a target the rules refuse (:func:`trim_refusal`) and nothing
    is written."""
    refusal = trim_refusal(partition_id, target, high_water_mark, min_kept_transactions)
    if refusal is not None:
        raise MetadataError(refusal)
    if grace_ms < 0:
        raise MetadataError(f"partition {partition_id}: grace {grace_ms} ms is negative")
    if grace_ms > 0:
        fv = read_feature_version(client, root)[0] if feature_version is None else feature_version
        if fv < PENDING_FEATURE_VERSION:
            raise MetadataError(
                f"partition {partition_id}: a trim point pending for a grace ({grace_ms} ms) needs feature "
                f"version {PENDING_FEATURE_VERSION}, and the cluster is at {fv}: raise it once every process "
                f"runs Waltz 0.2.0 or later (waltz cluster raise-features), or set the grace to 0 "
                f"(waltz cluster retention set --grace-ms 0, or trim with --grace-ms 0)"
            )
    path = ClusterPaths(root).trim_points
    with zk_errors("trim points"):
        client.ensure_path(path)
    seen: list[TrimEntry] = []
    now: list[int] = []

    def update(current: TrimPoints | None) -> bytes | None:
        points = current if current is not None else TrimPoints()
        now.append(clock_ms())
        seen.append(points.entry(partition_id).settled(now[-1]))
        new = next_entry(seen[-1], target, now[-1], grace_ms, source, replace_pending=replace_pending)
        return None if new is None else points.with_entry(partition_id, new).encode()

    compare_and_set(client, path, _decode_or_empty, update, "trim points")
    return _outcome(partition_id, target, seen[-1], grace_ms, now[-1], source, replace_pending)


def next_entry(
    entry: TrimEntry,
    target: int,
    now_ms: int,
    grace_ms: int,
    source: TrimSource,
    *,
    replace_pending: bool = True,
) -> TrimEntry | None:
    """The partition's entry after setting ``target`` at ``now_ms`` (``entry`` settled at ``now_ms``), or
    None if nothing changes (the rules of :func:`raise_trim_point`; no I/O)."""
    if target <= entry.requested or (entry.pending is not None and not replace_pending):
        return None
    if grace_ms == 0:
        return TrimEntry(target, now_ms)
    return replace(entry, pending=PendingTrim(target, now_ms, now_ms + grace_ms, source))


def _outcome(
    partition_id: int,
    target: int,
    before: TrimEntry,
    grace_ms: int,
    now_ms: int,
    source: TrimSource,
    replace_pending: bool,
) -> TrimOutcome:
    old = before.requested
    if target <= before.trim_point:
        line = f"partition {partition_id}: already trimmed to {before.trim_point}; nothing to do for {target}"
        return TrimOutcome(old, old, line, now_ms)
    if before.pending is not None and (target <= old or not replace_pending):
        at = format_time_ms(before.pending.effective_at_ms)
        line = (
            f"partition {partition_id}: trim point {old} is already pending (in force at {at}); nothing to "
            f"do for {target}"
        )
        return TrimOutcome(old, old, line, now_ms)
    if grace_ms == 0:
        log.info("partition %d: trim point raised from %d to %d", partition_id, old, target)
        line = f"partition {partition_id}: trim point raised from {old} to {target}"
        return TrimOutcome(old, target, line, now_ms)
    at_ms = now_ms + grace_ms
    replaced = f"; it replaces the pending trim point {old}" if before.pending is not None else ""
    line = (
        f"partition {partition_id}: trim point {target} pending, set by {source.label}; it takes effect at "
        f"{format_time_ms(at_ms)} (grace {grace_ms} ms, retention.graceMs){replaced}; until then nothing is "
        f"deleted and reads below it work (cancel: waltz cluster trim -p {partition_id} --cancel)"
    )
    log.info("%s", line)
    return TrimOutcome(old, target, line, at_ms)


def cancel_pending_trim(
    client: KazooClient, root: str, partition_id: int, *, clock_ms: Callable[[], int] = wall_clock_ms
) -> str:
    """Drop the partition's pending trim point, if its time has not come; returns one line saying what
    happened. The trim point in force never moves down: one in force cannot be cancelled."""
    path = ClusterPaths(root).trim_points
    seen: list[TrimEntry] = []

    def update(current: TrimPoints | None) -> bytes | None:
        points = current if current is not None else TrimPoints()
        entry = points.entry(partition_id).settled(clock_ms())
        seen.append(entry)
        if entry.pending is None:
            return None
        return points.with_entry(partition_id, replace(entry, pending=None)).encode()

    with zk_errors("trim points"):
        exists = client.exists(path) is not None
    if exists:
        compare_and_set(client, path, _decode_or_empty, update, "trim points")
    entry = seen[-1] if seen else NO_TRIM
    if entry.pending is None:
        return f"partition {partition_id}: no trim point pending (trim point in force: {entry.trim_point})"
    line = (
        f"partition {partition_id}: pending trim point {entry.pending.trim_point} cancelled (trim point in "
        f"force: {entry.trim_point})"
    )
    log.info("%s", line)
    return line


def describe_entry(partition_id: int, entry: TrimEntry, now_ms: int) -> str:
    """One line: the trim point in force and the pending one (when it takes effect), for operators."""
    settled = entry.settled(now_ms)
    line = f"partition {partition_id}: trim point {settled.trim_point}"
    p = settled.pending
    if p is not None:
        line += (
            f", pending {p.trim_point} (set by {p.source.label} at {format_time_ms(p.set_at_ms)}, "
            f"takes effect at {format_time_ms(p.effective_at_ms)}, "
            f"in {max(0, p.effective_at_ms - now_ms) // 1000} s)"
        )
    return line


def _decode_or_empty(raw: bytes) -> TrimPoints:
    return TrimPoints.decode(raw) if raw else TrimPoints()
