"""The retention policy: how much of each partition's log to keep, at ``<root>/store/retention``.

Absent, no partition is ever trimmed by a policy (a source of truth never deletes by surprise) and the grace
is :data:`DEFAULT_GRACE_MS`. Set with ``waltz cluster retention set`` (:func:`update_retention`); the server
that owns a partition applies its policy in the background (:mod:`waltz.server.retention`), and every trim
point, whoever sets it, waits out the grace before anything is deleted (:mod:`waltz.cluster.trim_points`).

* ``graceMs``: how long a trim point is pending before it takes effect (cluster-wide; 0: at once).
* ``keepTransactions``: keep the last N committed transactions of a partition (0: keep everything). A
  cluster-wide default, and a per-partition override that replaces it for that partition (an override of 0
  keeps everything there whatever the default says).

Encoding (big-endian, see :mod:`waltz.cluster.codec`)::

    u8   format version          (1)
    i64  grace ms                (0 .. MAX_GRACE_MS)
    i64  default keep transactions (>= 0; 0: keep everything)
    i32  n                       number of per-partition overrides
    n x:
        i32  partition id        (ascending, each once)
        i64  keep transactions   (>= 0; 0: keep everything)

Written only by :func:`update_retention`, version-checked; servers watch it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.cluster.codec import Reader, Writer
from waltz.cluster.zk import ClusterPaths, compare_and_set, zk_errors
from waltz.errors import MetadataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

DEFAULT_GRACE_MS = 3_600_000
"""One hour: long enough for an alert on a mistaken trim to reach someone who can cancel it, short enough
that the disk kept for it (an hour of writes) does not matter next to the log."""

MAX_GRACE_MS = 30 * 24 * 3_600_000
"""Thirty days: a longer grace is surely a typing mistake (the unit is milliseconds)."""


@dataclass(frozen=True)
class RetentionConfig:
    """The cluster's retention policy (the default when ``<root>/store/retention`` does not exist)."""

    grace_ms: int = DEFAULT_GRACE_MS
    keep_transactions: int = 0
    """The default policy: keep the last N transactions of each partition (0: keep everything)."""
    overrides: Mapping[int, int] = field(default_factory=dict)
    """Partition id -> keep transactions there (0: keep everything), replacing the default."""

    def keep_transactions_of(self, partition_id: int) -> int:
        return self.overrides.get(partition_id, self.keep_transactions)

    def encode(self) -> bytes:
        w = Writer().u8(FORMAT_VERSION).i64(self.grace_ms).i64(self.keep_transactions)
        w.i32(len(self.overrides))
        for pid in sorted(self.overrides):
            w.i32(pid).i64(self.overrides[pid])
        return w.bytes()

    @classmethod
    def decode(cls, raw: bytes) -> RetentionConfig:
        r = Reader(raw, "retention policy")
        r.version(FORMAT_VERSION)
        grace, keep = r.i64(), r.i64()
        if not 0 <= grace <= MAX_GRACE_MS or keep < 0:
            raise MetadataError(f"retention policy: bad grace {grace} ms or keep transactions {keep}")
        overrides: dict[int, int] = {}
        for _ in range(r.count()):
            pid, n = r.i32(), r.i64()
            if pid in overrides or pid < 0 or n < 0:
                raise MetadataError(f"retention policy: bad override for partition {pid} ({n})")
            overrides[pid] = n
        r.finish()
        return cls(grace, keep, overrides)

    def describe(self, num_partitions: int) -> list[str]:
        """Lines for operators: the grace, the default and each override."""
        lines = [f"grace: {self.grace_ms} ms (retention.graceMs)"]
        lines.append(f"default: {_keep_text(self.keep_transactions)}")
        for pid in sorted(self.overrides):
            extra = "" if pid < num_partitions else " (no such partition)"
            lines.append(f"partition {pid}: {_keep_text(self.overrides[pid])}{extra}")
        return lines


def _keep_text(keep: int) -> str:
    return f"keep the last {keep} transactions" if keep else "keep everything"


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


_UNCHANGED = -1


def update_retention(
    client: KazooClient,
    root: str,
    *,
    partition_id: int | None = None,
    keep_transactions: int | None = None,
    grace_ms: int | None = None,
    keep_all: bool = False,
    clear: bool = False,
) -> RetentionConfig:
    """Change the policy (version-checked) and return the new one. ``partition_id`` None edits the default;
    ``keep_all`` sets a policy of keeping everything (for a partition: whatever the default says);
    ``clear`` removes the default policy (keep everything) or the partition's override (the default
    applies). Raises MetadataError naming the bad value; nothing is written then."""
    refusal = retention_refusal(partition_id, keep_transactions, grace_ms, keep_all, clear)
    if refusal is not None:
        raise MetadataError(refusal)
    if partition_id is not None:
        num = sm.read_cluster_params(client, root).num_partitions
        if partition_id >= num:
            raise MetadataError(
                f"partition {partition_id} does not exist: the cluster has partitions 0..{num - 1}"
            )
    path = ClusterPaths(root).retention
    with zk_errors("retention policy"):
        client.ensure_path(path)
    result: list[RetentionConfig] = []

    def update(current: RetentionConfig) -> bytes | None:
        keep = 0 if keep_all else keep_transactions
        new = _edited(current, partition_id, keep, grace_ms, clear)
        result.append(new)
        return new.encode()

    compare_and_set(client, path, decode_or_default, update, "retention policy")
    log.info("retention policy set: %s", "; ".join(result[-1].describe(1 << 31)))
    return result[-1]


def _edited(
    current: RetentionConfig,
    partition_id: int | None,
    keep_transactions: int | None,
    grace_ms: int | None,
    clear: bool,
) -> RetentionConfig:
    grace = current.grace_ms if grace_ms is None else grace_ms
    keep, overrides = current.keep_transactions, dict(current.overrides)
    if partition_id is None:
        keep = 0 if clear else (keep if keep_transactions is None else keep_transactions)
    elif clear:
        overrides.pop(partition_id, None)
    elif keep_transactions is not None:
        overrides[partition_id] = keep_transactions
    return RetentionConfig(grace, keep, overrides)


def retention_refusal(
    partition_id: int | None,
    keep_transactions: int | None,
    grace_ms: int | None,
    keep_all: bool = False,
    clear: bool = False,
) -> str | None:
    """Why a policy edit is refused (naming the value), or None."""
    where = "the default" if partition_id is None else f"partition {partition_id}"
    if partition_id is not None and partition_id < 0:
        return f"partition {partition_id} does not exist (partition ids start at 0)"
    if sum((clear, keep_all, keep_transactions is not None)) > 1:
        return "give at most one of --keep-transactions, --keep-all and clear"
    if partition_id is not None and grace_ms is not None:
        return "the grace (--grace-ms) is cluster-wide: give it without --partition"
    if not (clear or keep_all) and keep_transactions is None and grace_ms is None:
        return "nothing to change: give --keep-transactions, --keep-all or --grace-ms"
    if keep_transactions is not None and keep_transactions <= 0:
        return (
            f"{where}: --keep-transactions {keep_transactions} would trim everything; keep at least 1 "
            f"(to keep everything, use --keep-all)"
        )
    if grace_ms is not None and not 0 <= grace_ms <= MAX_GRACE_MS:
        return f"--grace-ms {grace_ms} is outside 0..{MAX_GRACE_MS} (30 days; the unit is milliseconds)"
    return None


def policy_trim_point(keep_transactions: int, high_water_mark: int) -> int:
    """The trim point that keeps the last ``keep_transactions`` committed transactions up to
    ``high_water_mark`` (0: nothing to trim, or no policy)."""
    if keep_transactions <= 0:
        return 0
    return max(0, high_water_mark + 1 - keep_transactions)
