"""Which store session ids a storage node may let fence a partition: the cluster's metadata decides.

A store session id is taken by a version-checked write of ``<root>/store/partition/<id>`` in ZooKeeper
*before* the owning server sends its first request with it (``StorePartition._new_session``). So a session id
above the one ZooKeeper records for the partition was never handed out: it can only come from a peer that
made it up. Without this check one message carrying session id 2**62 fenced every real session of the
partition, and a second one persisted that fence in the control file.

The node asks ZooKeeper only when a request carries a session id above every id it has already verified for
that partition, which happens once per new store session per node; ordinary traffic compares two integers.
The read is preceded by a ``sync`` so a ZooKeeper follower that lags behind the leader cannot refuse a
session id the leader has already recorded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from kazoo.client import KazooClient

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.cluster.zk import ClusterPaths, zk_errors

log = logging.getLogger(__name__)

__all__ = ["SessionAuthority", "ZkSessionAuthority"]


class SessionAuthority(Protocol):
    """Tells a storage node the newest store session id the cluster has handed out for a partition."""

    async def newest_session_id(self, partition_id: int) -> int:
        """The newest session id recorded for ``partition_id``; raises a WaltzError when it cannot tell."""
        ...


class ZkSessionAuthority:
    """:class:`SessionAuthority` over a started kazoo client (owned by the caller, closed by the caller)."""

    def __init__(self, client: KazooClient, cluster_root: str, timeout_s: float) -> None:
        self._client = client
        self._paths = ClusterPaths(cluster_root)
        self._timeout_s = timeout_s

    async def newest_session_id(self, partition_id: int) -> int:
        # A blocking kazoo call runs in a thread; the wait is bounded (the thread ends with kazoo's own
        # command timeout).
        return await asyncio.wait_for(asyncio.to_thread(self._read, partition_id), self._timeout_s)

    def _read(self, partition_id: int) -> int:
        path = self._paths.partition(partition_id)
        what = f"partition metadata {partition_id}"
        with zk_errors(what):
            self._client.sync(path)
            raw, _ = self._client.get(path)
        return PartitionMetadata.decode(raw).session_id
