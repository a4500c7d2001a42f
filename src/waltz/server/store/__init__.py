"""The replication core of the Waltz server: store sessions, quorum writes, recovery.

Written against abstract interfaces (``interfaces.py``) with time and randomness injected, so the same code
runs in memory (``waltz.testing.store``, the fault simulator in ``tests/fault``) and against real storage
nodes and ZooKeeper. See ``docs/replication.md``.
"""

from waltz.server.store.interfaces import (
    AppendLike,
    PartitionMetadataStore,
    ReplicaConnection,
    ReplicaConnector,
    SessionInfo,
)
from waltz.server.store.store_partition import StorePartition
from waltz.server.store.store_session import EndReason, SessionOutcome, StoreSession
from waltz.server.store.support import InvariantViolation, StoreConfig
from waltz.server.store.voting import Voting, quorum_of, resolve_high_water_mark

__all__ = [
    "AppendLike",
    "EndReason",
    "InvariantViolation",
    "PartitionMetadataStore",
    "ReplicaConnection",
    "ReplicaConnector",
    "SessionInfo",
    "SessionOutcome",
    "StoreConfig",
    "StorePartition",
    "StoreSession",
    "Voting",
    "quorum_of",
    "resolve_high_water_mark",
]
