"""The retention policy: how much of each partition's log to keep, at ``<root>/store/retention``.

Absent, no partition is ever trimmed by a policy (a source of truth never deletes by surprise) and the grace
is :data:`DEFAULT_GRACE_MS`. Set with ``waltz cluster retention set`` (:func:`update_retention`); the server
that owns a partition applies its policy in the background (:mod:`waltz.server.retention`), and every trim
point, whoever sets it, waits out the grace before anything is deleted (:mod:`waltz.cluster.trim_points`).

* ``graceMs``: how long a trim point is pending before it takes effect (cluster-wide; 0: at once).
* ``keepTransactions``: keep the last N committed transactions of a partition (0: no limit).
* ``keepBytes``: keep the newest segments of a partition that hold at least N bytes on disk (data and index
  files of one replica; 0: no limit). It works in whole segments, as the deletion does.

Each limit bounds the partition: with both, the one that trims more applies. A cluster-wide default, and a
per-partition override that replaces both limits of the default for that partition (an override of 0 and 0
keeps everything there whatever the default says).

Encoding (big-endian, see :mod:`waltz.cluster.codec`)::

    u8   format version          (1)
    i64  grace ms                (0 .. MAX_GRACE_MS)
    i64  default keep transactions (>= 0; 0: no limit)
    i64  default keep bytes      (>= 0; 0: no limit)
    i32  n                       number of per-partition overrides
    n x:
        i32  partition id        (ascending, each once)
        i64  keep transactions   (>= 0; 0: no limit)
        i64  keep bytes          (>= 0; 0: no limit)

Written only by :func:`update_retention`, version-checked; servers watch it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.cluster.codec import Reader, Writer
from waltz.cluster.features import read_feature_version
from waltz.cluster.zk import ClusterPaths, compare_and_set, zk_errors
from waltz.errors import MetadataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

DEFAULT_GRACE_MS = 3_600_000
"""One hour: long enough for an alert on a mistaken trim to reach someone who can cancel it, short enough
that the disk kept for it (an hour of writes) does not matter next to the log."""

BYTES_FEATURE_VERSION = 2
"""The cluster feature version from which a limit in bytes may be set (storage message 26 is 0.2.0's)."""

MAX_GRACE_MS = 30 * 24 * 3_600_000
"""Thirty days: a longer grace is surely a typing mistake (the unit is milliseconds)."""


@dataclass(frozen=True)
class Limits:
    """How much of a partition to keep (0: no limit)."""

    keep_transactions: int = 0
    keep_bytes: int = 0

    @property
    def keeps_everything(self) -> bool:
        return self.keep_transactions == 0 and self.keep_bytes == 0

    def describe(self) -> str:
        parts = []
        if self.keep_transactions:
            parts.append(f"the last {self.keep_transactions} transactions")
        if self.keep_bytes:
            parts.append(f"the newest segments holding {self.keep_bytes} bytes")
        return "keep " + " and ".join(parts) if parts else "keep everything"


@dataclass(frozen=True)
class RetentionConfig:
    """The cluster's retention policy (the default when ``<root>/store/retention`` does not exist)."""

    grace_ms: int = DEFAULT_GRACE_MS
    default: Limits = field(default_factory=Limits)
    """The default policy of every partition without an override (keep everything unless set)."""
    overrides: Mapping[int, Limits] = field(default_factory=dict)
    """Partition id -> its limits, replacing the default's."""

    def limits_of(self, partition_id: int) -> Limits:
        return self.overrides.get(partition_id, self.default)

    def encode(self) -> bytes:
        w = Writer().u8(FORMAT_VERSION).i64(self.grace_ms)
        w.i64(self.default.keep_transactions).i64(self.default.keep_bytes)
        w.i32(len(self.overrides))
        for pid in sorted(self.overrides):
            limits = self.overrides[pid]
            w.i32(pid).i64(limits.keep_transactions).i64(limits.keep_bytes)
        return w.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> RetentionConfig:
        r = Reader(raw, "retention policy")
        r.version(FORMAT_VERSION)
        grace = r.i64()
        if not 0 <= grace <= MAX_GRACE_MS:
            raise MetadataError(f"retention policy: bad grace {grace} ms")
        default = _read_limits(r, "the default")
        overrides: dict[int, Limits] = {}
        for _ in range(r.count()):
            pid = r.i32()
            if pid in overrides or pid < 0:
                raise MetadataError(f"retention policy: bad override for partition {pid}")
            overrides[pid] = _read_limits(r, f"partition {pid}")
        r.finish()
        return cls(grace, default, overrides)

    def describe(self, num_partitions: int) -> list[str]:
        """Lines for operators: the grace, the default and each override."""
        lines = [f"grace: {self.grace_ms} ms (retention.graceMs)", f"default: {self.default.describe()}"]
        for pid in sorted(self.overrides):
            extra = "" if pid < num_partitions else " (no such partition)"
            lines.append(f"partition {pid}: {self.overrides[pid].describe()}{extra}")
        return lines


def _read_limits(r: Reader, where: str) -> Limits:
    keep_transactions, keep_bytes = r.i64(), r.i64()
    if keep_transactions < 0 or keep_bytes < 0:
        raise MetadataError(
            f"retention policy: {where} keeps {keep_transactions} transactions, {keep_bytes} bytes"
        )
    return Limits(keep_transactions, keep_bytes)


def read_retention(client: KazooClient, root: str) -> RetentionConfig:
    """The cluster's retention policy (the defaults if none was ever set)."""
    path = ClusterPaths(root).retention
    with zk_errors("retention policy"):
        if client.exists(path) is None:
            return RetentionConfig()
        raw, _ = client.get(path)
    return decode_or_default(raw)


def decode_or_default(raw: bytes | None) -> RetentionConfig:
    return RetentionConfig.decode(raw) if raw else RetentionConfig()


@dataclass(frozen=True)
class RetentionEdit:
    """One change to the policy (``waltz cluster retention set|clear``); None: unchanged."""

    partition_id: int | None = None
    """None: the default; else that partition's override."""
    keep_transactions: int | None = None
    keep_bytes: int | None = None
    grace_ms: int | None = None
    keep_all: bool = False
    """Set no limit (an override: the partition keeps everything whatever the default says)."""
    clear: bool = False
    """Remove the default's limits (keep everything) or the partition's override (the default applies)."""

    def refusal(self) -> str | None:
        """Why this edit is refused (naming the value), or None."""
        where = "the default" if self.partition_id is None else f"partition {self.partition_id}"
        limits = self.keep_transactions is not None or self.keep_bytes is not None
        if self.partition_id is not None and self.partition_id < 0:
            return f"partition {self.partition_id} does not exist (partition ids start at 0)"
        if sum((self.clear, self.keep_all, limits)) > 1:
            return "give only one of --keep-transactions/--keep-bytes, --keep-all and clear"
        if self.partition_id is not None and self.grace_ms is not None:
            return "the grace (--grace-ms) is cluster-wide: give it without --partition"
        if not (self.clear or self.keep_all or limits) and self.grace_ms is None:
            return "nothing to change: give --keep-transactions, --keep-bytes, --keep-all or --grace-ms"
        for name, value in (("transactions", self.keep_transactions), ("bytes", self.keep_bytes)):
            if value is not None and value <= 0:
                return (
                    f"{where}: --keep-{name} {value} would trim everything; keep at least 1 "
                    f"(to keep everything, use --keep-all)"
                )
        if self.grace_ms is not None and not 0 <= self.grace_ms <= MAX_GRACE_MS:
            return (
                f"--grace-ms {self.grace_ms} is outside 0..{MAX_GRACE_MS} (30 days; the unit is milliseconds)"
            )
        return None

    def applied(self, current: RetentionConfig) -> RetentionConfig:
        """``current`` with this edit made (a checked edit: see :meth:`refusal`)."""
        grace = current.grace_ms if self.grace_ms is None else self.grace_ms
        overrides = dict(current.overrides)
        pid = self.partition_id
        base = current.default if pid is None else overrides.get(pid, Limits())
        if self.clear or self.keep_all:
            new = Limits()
        else:
            new = Limits(
                base.keep_transactions if self.keep_transactions is None else self.keep_transactions,
                base.keep_bytes if self.keep_bytes is None else self.keep_bytes,
            )
        if pid is None:
            return RetentionConfig(grace, new, overrides)
        if self.clear:
            overrides.pop(pid, None)
        else:
            overrides[pid] = new
        return RetentionConfig(grace, current.default, overrides)


def update_retention(
    client: KazooClient, root: str, edit: RetentionEdit | None = None, **changes: Any
) -> RetentionConfig:
    """Make ``edit`` (or a RetentionEdit of ``changes``) to the policy (version-checked) and return the new
    one. Raises MetadataError naming the bad value; nothing is written then."""
    edit = edit if edit is not None else RetentionEdit(**changes)
    refusal = edit.refusal()
    if refusal is not None:
        raise MetadataError(refusal)
    if edit.keep_bytes:
        fv = read_feature_version(client, root)[0]
        if fv < BYTES_FEATURE_VERSION:
            raise MetadataError(
                f"--keep-bytes needs feature version {BYTES_FEATURE_VERSION} (the servers ask the storage "
                f"nodes with storage message 26, which Waltz 0.1.0 does not know), and the cluster is at "
                f"{fv}: raise it once every process runs Waltz 0.2.0 or later (waltz cluster raise-features)"
            )
    if edit.partition_id is not None:
        num = sm.read_cluster_params(client, root).num_partitions
        if edit.partition_id >= num:
            raise MetadataError(
                f"partition {edit.partition_id} does not exist: the cluster has partitions 0..{num - 1}"
            )
    path = ClusterPaths(root).retention
    with zk_errors("retention policy"):
        client.ensure_path(path)
    result: list[RetentionConfig] = []

    def update(current: RetentionConfig) -> bytes | None:
        result.append(edit.applied(current))
        return result[-1].encode()

    compare_and_set(client, path, decode_or_default, update, "retention policy")
    log.info("retention policy set: %s", "; ".join(result[-1].describe(1 << 31)))
    return result[-1]


def policy_trim_point(limits: Limits, high_water_mark: int, segments: Sequence[tuple[int, int]] = ()) -> int:
    """The trim point ``limits`` ask for at ``high_water_mark`` (0: nothing to trim, or no limit): the
    higher of the two limits' targets, never above ``high_water_mark`` (the last committed transaction is
    always kept). ``segments`` (``(first id, bytes)`` of a replica's newest segments, oldest first) is needed
    for a limit in bytes: the trim point is the first id of the oldest of the newest segments that hold
    ``keep_bytes`` together (0 if the segments listed hold fewer bytes)."""
    target = 0
    if limits.keep_transactions > 0:
        target = max(target, high_water_mark + 1 - limits.keep_transactions)
    if limits.keep_bytes > 0:
        total = 0
        for first, size in reversed(segments):
            total += size
            if total >= limits.keep_bytes:
                target = max(target, first)
                break
    return max(0, min(target, high_water_mark))
