"""``waltz cluster trim``: raise a partition's trim point (see ``docs/operations.md``, "Retention").

The high-water mark comes from the partition's owner (a HighWaterMarkRequest on its client port), so only
committed transactions are ever trimmed; the trim point is then raised in ZooKeeper
(:func:`waltz.cluster.trim_points.raise_trim_point`), and the owning server passes it to every replica.
Every refusal names the partition and says why; nothing is changed then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from ssl import SSLContext

from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.cluster.retention import read_retention
from waltz.cluster.trim_points import DEFAULT_MIN_KEPT_TRANSACTIONS as DEFAULT_MIN_KEPT_TRANSACTIONS
from waltz.cluster.trim_points import (
    TrimOutcome,
    TrimSource,
    cancel_pending_trim,
    describe_entry,
    raise_trim_point,
    read_trim_points,
    wall_clock_ms,
)
from waltz.errors import MetadataError, PartitionNotReadyError, RemoteProtocolError
from waltz.ops.servers import ADMIN_CLIENT_ID, query
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId


def owner_address(client: KazooClient, root: str, partition_id: int) -> str:
    """The client address of the server that owns ``partition_id``; MetadataError naming it if none."""
    params = sm.read_cluster_params(client, root)
    if not 0 <= partition_id < params.num_partitions:
        raise MetadataError(
            f"partition {partition_id} does not exist: the cluster has partitions "
            f"0..{params.num_partitions - 1}"
        )
    assignment, _ = sm.read_partition_assignment(client, root)
    owners = [sid for sid, parts in assignment.servers.items() if partition_id in parts]
    servers, _ = sm.read_server_descriptors(client, root)
    by_id = {d.server_id: d for d in servers.values()}
    for sid in owners:
        if sid in by_id:
            return by_id[sid].endpoint
    raise MetadataError(f"partition {partition_id} is not served by any live server; start one and retry")


async def high_water_mark(address: str, partition_id: int, ssl: SSLContext | None, timeout_ms: int) -> int:
    """The committed high-water mark the owner reports; PartitionNotReadyError if it does not serve it."""
    (answer,) = await query(
        address, [cs.HighWaterMarkRequest(ReqId.of(ADMIN_CLIENT_ID, 0, partition_id, 1))], timeout_ms, ssl
    )
    if not isinstance(answer, cs.HighWaterMarkResponse):
        raise RemoteProtocolError(f"unexpected answer from {address}: {type(answer).__name__}")
    if answer.transaction_id == cs.HWM_NOT_SERVED:
        raise PartitionNotReadyError(f"partition {partition_id} is not served by {address} right now; retry")
    return answer.transaction_id


def trim_partition(
    client: KazooClient,
    root: str,
    partition_id: int,
    *,
    to: int | None = None,
    keep_last: int | None = None,
    min_kept_transactions: int = DEFAULT_MIN_KEPT_TRANSACTIONS,
    grace_ms: int | None = None,
    ssl: SSLContext | None = None,
    timeout_ms: int = 10_000,
) -> TrimOutcome:
    """Trim to the id ``to`` (the lowest id kept), or keep only the last ``keep_last`` transactions. The trim
    point is pending for ``grace_ms`` (None: the cluster's ``retention.graceMs``), then in force."""
    if (to is None) == (keep_last is None):
        raise MetadataError("give exactly one of a trim point (--to) and a policy (--keep-last)")
    if keep_last is not None and keep_last <= 0:
        raise MetadataError(
            f"partition {partition_id}: --keep-last {keep_last} would trim everything; keep at least 1"
        )
    address = owner_address(client, root, partition_id)
    hwm = asyncio.run(high_water_mark(address, partition_id, ssl, timeout_ms))
    target = to if to is not None else max(0, hwm + 1 - (keep_last or 0))
    if grace_ms is None:
        grace_ms = read_retention(client, root).grace_ms
    return raise_trim_point(
        client,
        root,
        partition_id,
        target,
        hwm,
        min_kept_transactions=min_kept_transactions,
        grace_ms=grace_ms,
        source=TrimSource.OPERATOR,
    )


def cancel_trim(client: KazooClient, root: str, partition_id: int) -> str:
    """Cancel the partition's pending trim point (see :func:`.trim_points.cancel_pending_trim`)."""
    num = sm.read_cluster_params(client, root).num_partitions
    if not 0 <= partition_id < num:
        raise MetadataError(
            f"partition {partition_id} does not exist: the cluster has partitions 0..{num - 1}"
        )
    return cancel_pending_trim(client, root, partition_id)


def retention_status(
    client: KazooClient, root: str, *, clock_ms: Callable[[], int] = wall_clock_ms
) -> list[str]:
    """Lines for ``waltz cluster retention show``: the policy, then each partition's trim point in force and
    the pending one (when it takes effect)."""
    num = sm.read_cluster_params(client, root).num_partitions
    config = read_retention(client, root)
    points = read_trim_points(client, root)
    now = clock_ms()
    lines = config.describe(num)
    lines += [describe_entry(pid, points.entry(pid), now) for pid in range(num)]
    return lines
