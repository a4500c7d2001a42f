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

A standalone node (no ZooKeeper) has nobody to ask, so it bounds the *step* instead (:func:`step_refusal`):
store session ids grow by one per session attempt (the owner takes ``metadata.session_id + 1`` each time), so
a real new session is at most a modest number of ids above the newest one the node accepted for the
partition, whereas a corrupt or forged id (2**62) is far above it and would fence the partition for good: no
real session could ever catch up with it by steps of one. ``storage.maxSessionIdStep`` (default one million:
a session every 25 s, the checkpoint rate at 10,000 transactions/s, for 289 days) is that bound; a larger
jump is refused with a logged reason and fences nothing. The reference is the newest id accepted for the
partition since the node started, or persisted in its control file; a partition that never took part in a
session starts from -1. An operator who adds a replica to a partition whose session ids really are higher
raises the key (see docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from kazoo.client import KazooClient

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.cluster.zk import ClusterPaths, zk_errors

log = logging.getLogger(__name__)

__all__ = ["SessionAuthority", "ZkSessionAuthority", "step_refusal"]


def step_refusal(session_id: int, newest_accepted: int, max_step: int) -> str | None:
    """Why a standalone node refuses ``session_id`` for a partition whose newest accepted session id is
    ``newest_accepted`` (-1: none), or None if it may fence. Pure: the node keeps the state."""
    if session_id - max(newest_accepted, -1) <= max_step:
        return None
    return (
        f"session id {session_id} is {session_id - max(newest_accepted, -1)} above {newest_accepted}, the "
        f"newest this node accepted for the partition; storage.maxSessionIdStep allows {max_step}"
    )


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
